#include "pool.h"

#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FORKLINE_PAUSE() _mm_pause()
#else
#define FORKLINE_PAUSE() std::this_thread::yield()
#endif

namespace forkline {

namespace {

double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atof(v) : fallback;
}

PoolTuning initial_tuning() {
  PoolTuning t;
  t.spin_us = env_double("FORKLINE_KERNEL_SPIN_US", t.spin_us);
  t.yield = env_double("FORKLINE_KERNEL_YIELD", t.yield ? 1.0 : 0.0) != 0.0;
  return t;
}

std::atomic<double> g_spin_us{initial_tuning().spin_us};
std::atomic<bool> g_yield{initial_tuning().yield};
std::atomic<double> g_wake_us{PoolTuning{}.wake_us};
std::atomic<double> g_parallel_us{PoolTuning{}.parallel_us};

}  // namespace

WorkerPool::WorkerPool(int threads) {
  for (int part = 1; part < threads; ++part) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

WorkerPool::~WorkerPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  { std::lock_guard<std::mutex> lock(sleep_mutex_); }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void WorkerPool::drain(Job& job) {
  for (;;) {
    const int i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.tasks) {
      return;
    }
    (*job.task)(i);
  }
}

void WorkerPool::run(int tasks, const Task& task, bool wake) {
  if (tasks <= 0) {
    return;
  }
  if (workers_.empty() || tasks == 1) {
    for (int i = 0; i < tasks; ++i) {
      task(i);
    }
    return;
  }
  std::lock_guard<std::mutex> lock(run_mutex_);
  Job job{&task, tasks};
  current_.store(&job);
  generation_.fetch_add(1);
  // seq_cst with the worker's sleepers_ increment then generation_ check: either it sees the new
  // generation and does not sleep, or this sees it asleep (and waking it is up to `wake`)
  if (wake && sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> l(sleep_mutex_); }  // orders this after a sleeper's check-then-wait
    wake_.notify_all();
  }
  drain(job);
  // A worker enters (inside_++) before it reads current_: after this store either it reads null, or
  // its entry is seen below and waited for. Only workers already in a task are waited for.
  current_.store(nullptr);
  int spins = 0;
  while (inside_.load() != 0) {
    if (++spins < 4096) {
      FORKLINE_PAUSE();
    } else {
      sched_yield();
    }
  }
}

void WorkerPool::run_estimated(int tasks, double est_us, const Task& task) {
  if (workers_.empty() || est_us < g_parallel_us.load(std::memory_order_relaxed)) {
    for (int i = 0; i < tasks; ++i) {
      task(i);
    }
    return;
  }
  run(tasks, task, est_us >= g_wake_us.load(std::memory_order_relaxed));
}

void WorkerPool::worker_loop() {
  using clock = std::chrono::steady_clock;
  // generation_ is 0 at construction: reading it here instead would miss a job posted before this
  // thread first ran
  unsigned seen = 0;
  for (;;) {
    unsigned now = generation_.load(std::memory_order_acquire);
    if (now == seen) {
      const auto spin = std::chrono::duration<double, std::micro>(g_spin_us.load(std::memory_order_relaxed));
      const bool yield = g_yield.load(std::memory_order_relaxed);
      const auto start = clock::now();
      for (int it = 1; (now = generation_.load(std::memory_order_acquire)) == seen; ++it) {
        if (it % 16 == 0 && clock::now() - start > spin) {
          break;
        }
        if (yield) {
          sched_yield();
        } else {
          FORKLINE_PAUSE();
        }
      }
      if (now == seen) {
        sleepers_.fetch_add(1);
        {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          wake_.wait(lock, [&] { return (now = generation_.load()) != seen; });
        }
        sleepers_.fetch_sub(1);
      }
    }
    seen = now;
    if (stop_.load()) {
      return;
    }
    inside_.fetch_add(1);
    if (Job* job = current_.load()) {
      drain(*job);
    }
    inside_.fetch_sub(1);
  }
}

int default_threads() {
  if (const char* env = std::getenv("FORKLINE_KERNEL_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) {
      return n;
    }
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) {
      return n;
    }
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

PoolTuning pool_tuning() {
  PoolTuning t;
  t.spin_us = g_spin_us.load();
  t.yield = g_yield.load();
  t.wake_us = g_wake_us.load();
  t.parallel_us = g_parallel_us.load();
  return t;
}

void set_pool_tuning(const PoolTuning& t) {
  g_spin_us.store(t.spin_us);
  g_yield.store(t.yield);
  g_wake_us.store(t.wake_us);
  g_parallel_us.store(t.parallel_us);
}

namespace {
std::mutex g_pool_mutex;
std::unique_ptr<WorkerPool> g_pool;
}  // namespace

WorkerPool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) {
    g_pool = std::make_unique<WorkerPool>(default_threads());
  }
  return *g_pool;
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool.reset();  // join the old workers before starting new ones
  g_pool = std::make_unique<WorkerPool>(n > 0 ? n : default_threads());
}

int num_threads() {
  return pool().size();
}

}  // namespace forkline
