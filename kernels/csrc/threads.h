// The OpenMP team the kernels and torch's CPU ops share: pin its threads to CPUs.
#pragma once
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace pagedserve {

// Sets the calling thread's team to one thread per CPU and pins thread i to cpus[i] (thread 0 is the caller);
// returns each thread's Linux thread id. libgomp keeps the same threads for later teams of that size.
inline std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int count = int(cpus.size());
  std::vector<int64_t> ids(count, -1);
  std::vector<int> errors(count, 0);
  omp_set_num_threads(count);
#pragma omp parallel num_threads(count)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(int(cpus[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) errors[i] = errno;
    ids[i] = int64_t(syscall(SYS_gettid));
  }
  for (int i = 0; i < count; ++i) {
    if (ids[i] < 0) throw std::runtime_error("OpenMP gave fewer threads than CPUs to bind");
    if (errors[i] != 0)
      throw std::runtime_error("cannot pin a thread to CPU " + std::to_string(cpus[i]) + ": " +
                               std::strerror(errors[i]));
  }
  return ids;
}

}  // namespace pagedserve
