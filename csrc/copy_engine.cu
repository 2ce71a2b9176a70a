// Host<->device chunk copies issued as one batch on a caller's stream, and a pinned host pool.
//
// Why: moving a layer's chunks one cudaMemcpyAsync per Python call costs a launch and a GIL round trip
// each; issuing the whole list from C++ keeps the copy engine busy back to back. Asynchronous copies
// only overlap compute from page-locked memory, and cudaHostAlloc/cudaFreeHost are slow and
// synchronising, so freed pinned buffers are kept and handed out again to requests of the same size
// (chunks come in a few fixed sizes, so exact-size reuse is enough and never wastes a byte).
//
// Plain CUDA runtime with a C interface (no torch headers), so it builds wherever nvcc does; a binding
// layer passes raw pointers and the stream handle. Not exercised on a machine without a GPU.

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// Freed pinned buffers by exact byte size. Guarded by a mutex: frees can come from a copy thread.
class PinnedPool {
 public:
  cudaError_t acquire(size_t bytes, void** out) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = free_.find(bytes);
      if (found != free_.end() && !found->second.empty()) {
        *out = found->second.back();
        found->second.pop_back();
        return cudaSuccess;
      }
    }
    return cudaHostAlloc(out, bytes, cudaHostAllocDefault);  // outside the lock: it can take milliseconds
  }

  void release(void* ptr, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_[bytes].push_back(ptr);
  }

  // Returns every cached buffer to the driver; buffers still handed out are the caller's to release.
  cudaError_t trim(size_t* freed_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    cudaError_t status = cudaSuccess;
    size_t freed = 0;
    for (auto& [bytes, buffers] : free_) {
      for (void* ptr : buffers) {
        const cudaError_t err = cudaFreeHost(ptr);
        if (err != cudaSuccess && status == cudaSuccess) status = err;
        freed += bytes;
      }
    }
    free_.clear();
    if (freed_bytes != nullptr) *freed_bytes = freed;
    return status;
  }

  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t total = 0;
    for (const auto& [bytes, buffers] : free_) total += bytes * buffers.size();
    return total;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
};

PinnedPool& pool() {
  static PinnedPool instance;  // process lifetime: pinned memory is released by trim() or at exit
  return instance;
}

}  // namespace

extern "C" {

// Enqueues count copies dst[i] <- src[i] of bytes[i] bytes on `stream`, in order, without waiting.
// kind: cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost or cudaMemcpyDefault (unified addressing).
// Stops at the first failure and returns its error; *issued says how many were enqueued before it.
cudaError_t chunkmem_copy_batch(void* const* dst, const void* const* src, const size_t* bytes, int count,
                                cudaMemcpyKind kind, cudaStream_t stream, int* issued) {
  int i = 0;
  cudaError_t status = cudaSuccess;
  for (; i < count; ++i) {
    if (bytes[i] == 0) continue;
    status = cudaMemcpyAsync(dst[i], src[i], bytes[i], kind, stream);
    if (status != cudaSuccess) break;
  }
  if (issued != nullptr) *issued = i;
  return status;
}

cudaError_t chunkmem_pinned_acquire(size_t bytes, void** out) { return pool().acquire(bytes, out); }

// The caller must know the copies reading or writing `ptr` are done (e.g. an event after them).
void chunkmem_pinned_release(void* ptr, size_t bytes) { pool().release(ptr, bytes); }

cudaError_t chunkmem_pinned_trim(size_t* freed_bytes) { return pool().trim(freed_bytes); }

size_t chunkmem_pinned_cached_bytes() { return pool().cached_bytes(); }

}  // extern "C"
