// A persistent worker pool: threads are created once and reused by every kernel call.
//
// run(fn) calls fn(part, parts) once for each part in [0, parts) where parts is the pool size; the
// calling thread takes part 0, so a pool of one thread runs everything inline. Workers spin briefly
// after a job (decode issues ~150 kernel calls per step, microseconds apart) and then sleep on a futex
// (a condition variable), so an idle engine does not burn the cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace forkline {

class WorkerPool {
 public:
  using Job = std::function<void(int part, int parts)>;

  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }
  // Runs job on every part and returns when all parts are done. Calls are serialized.
  void run(const Job& job);

 private:
  void worker_loop(int part);
  void wake_all();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time (several MLX streams may call in)
  const Job* job_ = nullptr;
  std::atomic<unsigned> generation_{0};  // bumped once per job; workers wait for a change
  std::atomic<int> pending_{0};  // workers still running the current job
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;  // sleeping workers: generation_ is re-checked under it before waiting
  std::condition_variable wake_;
};

// The process-wide pool, created on first use with default_threads() threads.
WorkerPool& pool();
// Resizes the process-wide pool (n < 1: default_threads()). Not while a kernel runs.
void set_num_threads(int n);
int num_threads();
// FORKLINE_KERNEL_THREADS when set, otherwise the CPUs this process may run on.
int default_threads();

}  // namespace forkline
