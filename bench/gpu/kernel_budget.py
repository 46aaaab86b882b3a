#!/usr/bin/env python3
"""Where a step's time goes, kernel by kernel.

Reads an Nsight Compute listing of `moe-bench-engine --profile-steps N`
(ncu --profile-from-start off --clock-control none --print-units base
 --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
 -o REPORT ...; then ncu --import REPORT.ncu-rep --csv --page raw
 --print-units base > CSV) and the bench's own output (LOG), and prints per
profiled phase a table: each kernel's launches, time and device-memory bytes a
step, its achieved bandwidth, its share of the kernels' sum, and that sum
against the step's wall time (the rest is launch gaps, dependency waits and
the host's part of the step). Each kernel ran alone under the profiler, with
the caches flushed before it, as weights are in a real step.

  kernel_budget.py CSV LOG [--json OUT]
"""
import argparse
import csv
import json
import re
import sys


def base_name(full):
    """The kernel's function name and its template arguments, without
    namespaces or parameters: q4_rows_kernel<bf16,2,true,true,2>."""
    name = full
    # drop the parameter list (the last top-level parenthesised part)
    depth, cut = 0, len(name)
    for i in range(len(name) - 1, -1, -1):
        c = name[i]
        if c == ')':
            depth += 1
        elif c == '(':
            depth -= 1
            if depth == 0:
                cut = i
                break
    name = name[:cut]
    if name.startswith('void '):
        name = name[5:]
    tmpl = ''
    if '<' in name:
        i = name.index('<')
        name, tmpl = name[:i], name[i:]
    name = name.split('::')[-1]
    tmpl = (tmpl.replace('__nv_bfloat16', 'bf16').replace('(moe::cuda::', '(')
            .replace('moe::cuda::', '').replace(' ', ''))
    return name + tmpl


def number(text):
    """A figure as ncu prints it (thousands separated by commas)."""
    return float(text.replace(',', ''))


def read_phases(log_path):
    """[(label, wall ms a step or None)] in the order the bench printed them."""
    phases = []
    pending = None
    with open(log_path) as f:
        for line in f:
            m = re.match(r'profiled phase (\d+): (.*)$', line.strip())
            if m:
                pending = len(phases)
                phases.append({'label': m.group(2), 'wall_ms': None})
                continue
            m = re.match(r'\s*(decode|prefill) b(\d+): ([\d.]+) tok/s', line)
            if m and pending is not None:
                tokens = int(m.group(2))
                phases[pending]['wall_ms'] = tokens * 1000.0 / float(m.group(3))
                phases[pending]['tokens'] = tokens
                pending = None
    return phases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('csv')
    ap.add_argument('log')
    ap.add_argument('--json')
    a = ap.parse_args()
    phases = read_phases(a.log)
    rows = list(csv.DictReader(open(a.csv)))
    rows = [r for r in rows if r.get('ID', '').strip().isdigit()]  # drops the units row
    if not rows:
        sys.exit('kernel_budget: no kernels in ' + a.csv)
    current, per_phase = None, {}
    key = 'Kernel Name' if 'Kernel Name' in rows[0] else 'Function Name'
    for r in rows:
        r['Kernel Name'] = r[key]
        name = r['Kernel Name']
        if 'phase_marker' in name:
            grid = re.findall(r'\d+', r['Grid Size'])
            current = int(grid[0])
            per_phase.setdefault(current, [])
            continue
        if current is None:
            continue
        per_phase[current].append(r)
    out = []
    for idx, ks in sorted(per_phase.items()):
        ph = phases[idx - 1] if idx - 1 < len(phases) else {'label': 'phase %d' % idx, 'wall_ms': None}
        m = re.search(r'(\d+) steps?', ph['label'])
        steps = int(m.group(1)) if m else 1
        groups = {}
        order = []
        for r in ks:
            n = base_name(r['Kernel Name'])
            if n not in groups:
                groups[n] = {'kernel': n, 'launches': 0, 'ns': 0.0, 'read': 0.0, 'write': 0.0}
                order.append(n)
            g = groups[n]
            g['launches'] += 1
            g['ns'] += number(r['gpu__time_duration.sum'])
            g['read'] += number(r['dram__bytes_read.sum'])
            g['write'] += number(r['dram__bytes_write.sum'])
        total_ns = sum(g['ns'] for g in groups.values()) / steps
        total_bytes = sum(g['read'] + g['write'] for g in groups.values()) / steps
        wall = ph.get('wall_ms')
        print('\n## %s' % ph['label'])
        print('kernels: %d a step, %.1f us a step summed, %.1f MB a step (%.0f GB/s over the sum)%s' % (
            len(ks) // steps, total_ns / 1e3, total_bytes / 1e6, total_bytes / max(total_ns, 1),
            '; wall %.1f us a step: %.1f us (%.0f %%) outside the kernels' % (
                wall * 1e3, wall * 1e3 - total_ns / 1e3, 100 * (1 - total_ns / 1e3 / (wall * 1e3)))
            if wall else ''))
        print('| kernel | launches | us a step | share | MB a step | GB/s | us a launch |')
        print('|---|---|---|---|---|---|---|')
        table = []
        for n in sorted(order, key=lambda n: -groups[n]['ns']):
            g = groups[n]
            us = g['ns'] / steps / 1e3
            mb = (g['read'] + g['write']) / steps / 1e6
            row = {'kernel': n, 'launches_per_step': g['launches'] / steps, 'us_per_step': us,
                   'share': g['ns'] / steps / max(total_ns, 1), 'mb_per_step': mb,
                   'gb_s': (g['read'] + g['write']) / max(g['ns'], 1),
                   'us_per_launch': g['ns'] / g['launches'] / 1e3}
            table.append(row)
            print('| %s | %.0f | %.1f | %.1f %% | %.2f | %.0f | %.2f |' % (
                n[:90], row['launches_per_step'], us, 100 * row['share'], mb, row['gb_s'], row['us_per_launch']))
        out.append({'phase': ph['label'], 'wall_us_per_step': wall * 1e3 if wall else None,
                    'kernel_us_per_step': total_ns / 1e3, 'mb_per_step': total_bytes / 1e6, 'kernels': table})
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(out, f, indent=1)


if __name__ == '__main__':
    main()
