#include "pool.h"

#include <sched.h>

#include <cstdlib>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FORKLINE_PAUSE() _mm_pause()
#else
#define FORKLINE_PAUSE() std::this_thread::yield()
#endif

namespace forkline {

namespace {
// Spin iterations before a worker sleeps: ~10-100 us (a pause costs 10-140 cycles by CPU), longer
// than the gap between two kernel calls of one decode step, far shorter than an idle engine's gaps.
constexpr int kSpin = 2000;
}  // namespace

WorkerPool::WorkerPool(int threads) {
  for (int part = 1; part < threads; ++part) {
    workers_.emplace_back([this, part] { worker_loop(part); });
  }
}

WorkerPool::~WorkerPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  wake_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void WorkerPool::wake_all() {
  // Taking the mutex orders this after any worker's check-then-wait: no wakeup is lost.
  { std::lock_guard<std::mutex> lock(sleep_mutex_); }
  wake_.notify_all();
}

void WorkerPool::run(const Job& job) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  const int parts = size();
  if (parts == 1) {
    job(0, 1);
    return;
  }
  job_ = &job;
  pending_.store(parts - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  wake_all();
  job(0, parts);
  int spins = 0;
  while (pending_.load(std::memory_order_acquire) != 0) {
    if (++spins < kSpin) {
      FORKLINE_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
  job_ = nullptr;
}

void WorkerPool::worker_loop(int part) {
  // generation_ is 0 at construction: reading it here instead would miss a job posted before this
  // thread first ran (the pool is created and used at once), and that run() would wait forever
  unsigned seen = 0;
  for (;;) {
    int spins = 0;
    unsigned now;
    while ((now = generation_.load(std::memory_order_acquire)) == seen) {
      if (++spins < kSpin) {
        FORKLINE_PAUSE();
      } else {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
    }
    seen = now;
    if (stop_.load()) {
      return;
    }
    (*job_)(part, size());
    pending_.fetch_sub(1, std::memory_order_acq_rel);
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
  g_pool = std::make_unique<WorkerPool>(n > 0 ? n : default_threads());
}

int num_threads() {
  return pool().size();
}

}  // namespace forkline
