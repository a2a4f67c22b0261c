// Items [0, count) spread over torch's intra-op threads from one shared counter: each
// thread claims the next unclaimed item when it is free, in index order. With a fixed share
// per thread, the thread whose rows streamed slower kept the other waiting at the end of
// every decode-step linear; claiming also lets an item wait on the stage of
// an earlier item (A2ATS), which is always claimed first.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ragkv {

template <typename Fn>
inline void for_each_claimed(int64_t count, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < count;
         item = next.fetch_add(1, std::memory_order_relaxed))
      fn(item);
  });
}

}  // namespace ragkv
