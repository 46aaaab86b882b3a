#pragma once
// The /experts page (docs/experts-page.md): one self-contained HTML
// document whose script reads /experts.json once a second and draws, per
// worker, a heat map of its experts (rows MoE layers, columns experts:
// resident, hot, predicted, missed) and the hit rate and expert bytes per
// token over time. The key: the browser's own Basic login (the key as the
// password), which its requests for the data carry too.

namespace moe::gw {

const char* experts_page_html();

}  // namespace moe::gw
