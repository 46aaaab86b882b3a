#include "gateway/sched/worker_supervisor.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gateway/last_resort.h"

namespace moe::gw {

namespace fs = std::filesystem;

namespace {
bool is_executable(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
}

// The text of /proc/PID/cmdline with its NULs as spaces ("" when gone).
std::string command_line(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : s)
    if (c == '\0') c = ' ';
  return s;
}

int read_pid(const fs::path& file) {
  std::ifstream in(file);
  int pid = 0;
  return (in >> pid) && pid > 0 ? pid : 0;
}

void write_pid(const fs::path& file, int pid) {
  std::ofstream out(file, std::ios::trunc);
  out << pid << '\n';
}

template <typename H>
void close_and_free(H* h) {
  if (!h) return;
  h->data = nullptr;
  auto* base = reinterpret_cast<uv_handle_t*>(h);
  if (!uv_is_closing(base)) uv_close(base, [](uv_handle_t* x) { delete reinterpret_cast<H*>(x); });
}
}  // namespace

Result<std::string> find_worker_binary(const std::string& explicit_path) {
  if (!explicit_path.empty()) {
    if (!is_executable(explicit_path)) return make_error("worker binary " + explicit_path + " is not executable");
    return explicit_path;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const fs::path& p : {self.parent_path() / ".." / "worker" / "moe-worker", self.parent_path() / "moe-worker"})
      if (is_executable(p)) return fs::weakly_canonical(p, ec).string();
  }
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string dir;
    while (std::getline(ss, dir, ':'))
      if (!dir.empty() && is_executable(fs::path(dir) / "moe-worker")) return (fs::path(dir) / "moe-worker").string();
  }
  return make_error("cannot find moe-worker next to the gateway or on PATH");
}

size_t WorkerSupervisor::remove_stale_folders(const std::string& temp_dir) {
  size_t removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(temp_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("moe-gateway-", 0) != 0 || !entry.is_directory(ec)) continue;
    struct stat st{};
    if (::lstat(entry.path().c_str(), &st) != 0 || st.st_uid != ::geteuid() || !S_ISDIR(st.st_mode)) continue;
    if (read_pid(entry.path() / "gateway.pid") == int(::getpid())) continue;  // this process' own
    // A live owner holds a lock on its gateway.pid for as long as it runs
    // (whatever its program is called): a lock we can take means no owner.
    const int fd = ::open((entry.path() / "gateway.pid").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      // No pid file yet: a gateway may be making it this instant; only old ones go.
      if (::time(nullptr) - st.st_mtime < 60) continue;
    } else {
      const bool owned = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
      ::close(fd);
      if (owned) continue;
    }
    // A child of a gone gateway that is still there (started before
    // --parent-pid existed, or frozen) holds memory, maybe VRAM: it goes.
    const int child = read_pid(entry.path() / "worker.pid");
    if (child > 0 && command_line(child).find(entry.path().string()) != std::string::npos) {
      std::fprintf(stderr, "moe-gateway: killing moe-worker %d left by a gone gateway in %s\n", child,
                   entry.path().c_str());
      ::kill(child, SIGKILL);
    }
    fs::remove_all(entry.path(), ec);
    if (!ec) {
      ++removed;
      std::fprintf(stderr, "moe-gateway: removed the stale folder %s\n", entry.path().c_str());
    }
  }
  return removed;
}

Result<std::unique_ptr<WorkerSupervisor>> WorkerSupervisor::start(uv_loop_t* loop, SupervisorOptions opts) {
  std::unique_ptr<WorkerSupervisor> s(new WorkerSupervisor(loop, std::move(opts)));
  std::error_code ec;
  const fs::path temp = fs::temp_directory_path(ec);
  remove_stale_folders(temp.string());
  std::string tmpl = (temp / "moe-gateway-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) return make_error(std::string("mkdtemp: ") + std::strerror(errno));  // 0700
  s->dir_ = tmpl;
  // The pid file stays open and locked while this supervisor lives: the
  // sign, for other gateways' cleanup, that the folder is in use.
  const std::string pid_file = (fs::path(tmpl) / "gateway.pid").string();
  s->lock_fd_ = ::open(pid_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (s->lock_fd_ < 0 || ::flock(s->lock_fd_, LOCK_EX) != 0)
    return make_error("cannot lock " + pid_file + ": " + std::strerror(errno));
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::write(s->lock_fd_, pid.data(), pid.size()) != ssize_t(pid.size()))
    return make_error("cannot write " + pid_file + ": " + std::strerror(errno));
  s->socket_path_ = tmpl + "/" + s->opts_.socket_name;
  s->backoff_ms_ = s->opts_.restart_min_ms;
  s->restart_timer_ = new uv_timer_t;
  uv_timer_init(loop, s->restart_timer_);
  s->restart_timer_->data = s.get();
  if (auto st = s->spawn(); !st.ok()) return make_error(st.error());
  return s;
}

WorkerSupervisor::~WorkerSupervisor() {
  if (proc_) {
    uv_process_kill(proc_, SIGTERM);
    close_and_free(proc_);
  }
  close_and_free(restart_timer_);
  // The child unlinks its socket as it exits, perhaps while the folder is
  // being emptied: a few tries.
  for (int i = 0; i < 20 && !dir_.empty(); ++i) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    if (!fs::exists(dir_, ec)) break;
    ::usleep(10'000);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

int WorkerSupervisor::child_pid() const { return proc_ ? proc_->pid : 0; }

void WorkerSupervisor::kill_child(const char* why) {
  if (!proc_) return;
  std::fprintf(stderr, "moe-gateway: killing moe-worker (pid %d): %s\n", proc_->pid, why);
  uv_process_kill(proc_, SIGKILL);
}

Status WorkerSupervisor::spawn() {
  std::vector<std::string> args = {opts_.worker_bin, "--model",      opts_.model_path,
                                   "--socket",       socket_path_,  "--parent-pid",
                                   std::to_string(::getpid())};
  args.insert(args.end(), opts_.extra_args.begin(), opts_.extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  uv_stdio_container_t stdio[3];
  stdio[0].flags = UV_IGNORE;
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = 2;  // the worker's output goes to the gateway's log
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = 2;
  uv_process_options_t po{};
  po.file = argv[0];
  po.args = argv.data();
  po.exit_cb = &WorkerSupervisor::on_exit;
  po.stdio_count = 3;
  po.stdio = stdio;
  auto* p = new uv_process_t;
  p->data = this;
  const int rc = uv_spawn(loop_, p, &po);
  if (rc < 0) {
    // A failed uv_spawn still initialised the handle: it must be closed.
    close_and_free(p);
    return make_error("cannot start " + opts_.worker_bin + ": " + uv_strerror(rc));
  }
  proc_ = p;
  started_ms_ = uv_now(loop_);
  write_pid(fs::path(dir_) / "worker.pid", p->pid);
  std::fprintf(stderr, "moe-gateway: started moe-worker (pid %d) on %s\n", p->pid, socket_path_.c_str());
  return {};
}

void WorkerSupervisor::on_exit(uv_process_t* p, int64_t status, int signal) {
  auto* self = static_cast<WorkerSupervisor*>(p->data);
  close_and_free(p);
  if (!self) return;
  last_resort("a worker's exit", [&] { self->exited(status, signal); });
}

void WorkerSupervisor::exited(int64_t status, int signal) {
  WorkerSupervisor* self = this;
  self->proc_ = nullptr;
  // Killed by a signal, or exited with a status: one or the other.
  const std::string how = signal != 0 ? std::string("killed by signal ") + std::to_string(signal) + " (" +
                                            strsignal(signal) + ")"
                                      : "exited with status " + std::to_string(status);
  std::fprintf(stderr, "moe-gateway: moe-worker %s; restarting in %llu ms\n", how.c_str(),
               static_cast<unsigned long long>(self->backoff_ms_));
  self->count_failure(how);
  // A worker that ran a while earns a fresh backoff; one that dies at once waits longer each time.
  if (uv_now(self->loop_) - self->started_ms_ > 30000) self->backoff_ms_ = self->opts_.restart_min_ms;
  uv_timer_start(self->restart_timer_, &WorkerSupervisor::on_restart_timer, self->backoff_ms_, 0);
  self->backoff_ms_ = std::min(self->opts_.restart_max_ms, self->backoff_ms_ * 2);
}

void WorkerSupervisor::on_restart_timer(uv_timer_t* t) {
  auto* self = static_cast<WorkerSupervisor*>(t->data);
  if (!self || self->proc_) return;
  last_resort("restarting the worker", [self] { self->restart(); });
}

void WorkerSupervisor::restart() {
  WorkerSupervisor* self = this;
  ++self->restarts_;
  if (auto st = self->spawn(); !st.ok()) {
    std::fprintf(stderr, "moe-gateway: %s\n", st.error().c_str());
    self->count_failure(st.error());
    uv_timer_start(self->restart_timer_, &WorkerSupervisor::on_restart_timer, self->backoff_ms_, 0);
    self->backoff_ms_ = std::min(self->opts_.restart_max_ms, self->backoff_ms_ * 2);
  }
}

void WorkerSupervisor::count_failure(std::string what) {
  last_failure_ = std::move(what);
  if (++failed_starts_ != opts_.failing_after) return;
  std::fprintf(stderr, "moe-gateway: the worker is failing: %s\n", failing_reason().c_str());
  if (on_failing_) on_failing_();
}

std::string WorkerSupervisor::failing_reason() const {
  if (!failing()) return "";
  return "The worker failed " + std::to_string(failed_starts_) + " times in a row before it was ready (last: " +
         last_failure_ + "); the server keeps restarting it, at most " +
         std::to_string((opts_.restart_max_ms + 999) / 1000) + " s apart. Its log says why.";
}

}  // namespace moe::gw
