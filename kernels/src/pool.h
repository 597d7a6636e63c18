// A persistent worker pool with work sharing: threads are created once and reused by every kernel call.
//
// run(tasks, fn) calls fn(i) once for every i in [0, tasks) and returns when all have run. The calling
// thread claims tasks from a shared counter from the start; workers join as soon as they notice the
// job and claim from the same counter, so a worker that is slow to wake (asleep, or its core busy with
// another thread) only means the caller does more of the tasks: the caller never waits for a worker
// that has not started a task, only for one in the middle of one. Which thread runs a task must never
// change a value (every kernel here computes each output the same way wherever it runs).
//
// Idle policy: after a job a worker spins (pause) for spin_us microseconds, checking for the next
// one (decode issues ~150 kernel calls a step, tens of microseconds apart), optionally yielding the
// core (sched_yield) to other runnable threads while it spins; then it sleeps on a condition
// variable. run() wakes sleeping workers only when its caller says the job is worth it (wake = true):
// a short job is done by the caller and the spinning workers alone.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace forkline {

struct PoolTuning {
  double spin_us = 100.0;  // how long an idle worker spins before it sleeps
  bool yield = true;  // sched_yield between spins (lets another runnable thread have the core)
  double wake_us = 40.0;  // wake sleeping workers for jobs estimated at least this long (one thread)
  double parallel_us = 8.0;  // below this estimated time a job runs on the caller alone
};

class WorkerPool {
 public:
  using Task = std::function<void(int task)>;

  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }
  // Runs task(i) for i in [0, tasks) on the caller and any workers that join; returns when all ran.
  // wake: also wake sleeping workers. Calls are serialized.
  void run(int tasks, const Task& task, bool wake = true);
  // run() with the policy applied to a job of `est_us` single-thread microseconds: the caller alone
  // below parallel_us, waking sleepers from wake_us.
  void run_estimated(int tasks, double est_us, const Task& task);

 private:
  struct Job {
    const Task* task;
    int tasks;
    std::atomic<int> next{0};
  };
  void worker_loop();
  static void drain(Job& job);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time (several MLX streams may call in)
  std::atomic<Job*> current_{nullptr};  // the job being shared, null between jobs
  std::atomic<unsigned> generation_{0};  // bumped once per job; idle workers watch it
  std::atomic<int> inside_{0};  // workers that may be reading current_'s job
  std::atomic<int> sleepers_{0};  // workers asleep (or about to be) on wake_
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

// The process-wide pool, created on first use with default_threads() threads.
WorkerPool& pool();
// Resizes the process-wide pool (n < 1: default_threads()). Not while a kernel runs.
void set_num_threads(int n);
int num_threads();
// FORKLINE_KERNEL_THREADS when set, otherwise the CPUs this process may run on.
int default_threads();
// The idle / wake policy (process-wide; FORKLINE_KERNEL_SPIN_US, FORKLINE_KERNEL_YIELD=0/1 at start).
PoolTuning pool_tuning();
void set_pool_tuning(const PoolTuning& t);

}  // namespace forkline
