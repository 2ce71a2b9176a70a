// The CUDA copy engine: dedicated host-to-device and device-to-host streams, events that fence chunk
// use, batched copies of a list of chunks in one call, and raw page-locked host allocation.
//
// Why: moving a layer's chunks one cudaMemcpyAsync per Python call costs a launch and a GIL round trip
// each; issuing the whole list from C++ keeps the copy engine busy back to back. Copies only overlap
// compute from page-locked memory and on a stream other than the compute stream, one per direction
// so uploads (prefetch) and downloads (eviction) run concurrently on the GPU's two copy engines.
//
// Two layers. The C functions first use only the CUDA runtime, so `nvcc -c` builds them anywhere nvcc
// runs. The Python binding after them is compiled when torch.utils.cpp_extension builds this file
// (it defines TORCH_EXTENSION_NAME; see chunkmem/native.py). Reusing pinned buffers, capping them and
// falling back to pageable memory is chunkmem/hostpool.py's policy: this file only allocates and frees.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

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

// Exactly `bytes` of page-locked host memory (the driver rounds to pages, nothing more). Portable: it
// counts as pinned in every device's context, so a chunk can move to any GPU of the process.
cudaError_t chunkmem_pinned_alloc(size_t bytes, void** out) {
  const cudaError_t status = cudaHostAlloc(out, bytes, cudaHostAllocPortable);
  // An allocation failure is not sticky, but it stays the "last error" until read, and torch's next
  // kernel-launch check would report it as its own: clear it here, the caller has the status.
  if (status != cudaSuccess) (void)cudaGetLastError();
  return status;
}

// cudaFreeHost synchronises the device: free rarely (the pool keeps blocks for reuse).
cudaError_t chunkmem_pinned_free(void* ptr) { return cudaFreeHost(ptr); }

}  // extern "C"

#ifdef TORCH_EXTENSION_NAME

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Errors come back to Python as values, never as C++ exceptions: on the lent H100's build a TORCH_CHECK thrown
// from this extension ended the process (a segmentation fault) instead of raising, so an argument error or a
// refused cudaHostAlloc (which chunkmem must survive: hostpool.py falls back to pageable memory) was fatal.
// chunkmem/memory/native.py checks the arguments again and raises RuntimeError with these messages.
std::string failure(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return "";
  (void)cudaGetLastError();  // see chunkmem_pinned_alloc
  return std::string("chunkmem copy engine: ") + what + " failed with CUDA error " +
         std::to_string(static_cast<int>(status)) + " (" + cudaGetErrorString(status) + ")";
}

// Makes `device` current for the scope. torch's guard, not cudaSetDevice/cudaGetDevice by hand: restoring
// the previous device with cudaSetDevice would create a context on it (GPU 0 for a thread that never
// chose one), half a GiB on a GPU this rank does not use; torch's guard skips devices without one.
using DeviceGuard = c10::cuda::CUDAGuard;

// Marks a point on a stream. Compute waits on it before touching an uploaded chunk (`wait`, which does
// not block the host); host code waits on it before reading a downloaded one (`synchronize`). Each call
// returns "" or what failed.
class Event {
 public:
  explicit Event(int device) : device_(device) {}
  // Destroying an event whose work is still pending is legal: the driver releases it once it completes. On its own
  // device: the garbage collector may drop the last token on a thread that never chose one.
  ~Event() {
    if (event_ == nullptr) return;
    try {
      DeviceGuard guard(static_cast<c10::DeviceIndex>(device_));
      (void)cudaEventDestroy(event_);
    } catch (...) {  // a destructor must not throw (the guard does where the driver is gone at exit)
    }
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  std::string record(cudaStream_t stream) {
    DeviceGuard guard(static_cast<c10::DeviceIndex>(device_));
    std::string error = failure(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return error.empty() ? failure(cudaEventRecord(event_, stream), "cudaEventRecord") : error;
  }

  // Work queued on `stream` (a cudaStream_t as an integer, e.g. torch.cuda.current_stream().cuda_stream)
  // after this call starts only once the copies before the event are done.
  std::string wait(std::uintptr_t stream) const {
    try {  // returned, never thrown (CopyEngine::copy)
      DeviceGuard guard(static_cast<c10::DeviceIndex>(device_));
      return failure(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), event_, 0), "cudaStreamWaitEvent");
    } catch (const std::exception& caught) {
      return std::string("chunkmem copy engine: ") + caught.what();
    }
  }

  std::string synchronize() const {
    pybind11::gil_scoped_release no_gil;
    return failure(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

  // (done, error)
  std::pair<bool, std::string> query() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return {false, ""};
    }
    std::string error = failure(status, "cudaEventQuery");
    return {error.empty(), error};
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

// What is wrong with a batch of copies for the engine of `device`, or "" when nothing is (native.py checks the
// same before calling, with the same words).
std::string invalid(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, int device) {
  if (dst.size() != src.size()) {
    return "chunkmem copy engine: " + std::to_string(dst.size()) + " destinations but " + std::to_string(src.size()) +
           " sources; pass one of each per chunk";
  }
  if (dst.empty()) return "chunkmem copy engine: empty batch; pass at least one chunk";
  const bool upload = dst[0].is_cuda();
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& device_side = upload ? dst[i] : src[i];
    const at::Tensor& host_side = upload ? src[i] : dst[i];
    if (!device_side.is_cuda() || device_side.get_device() != device || !host_side.is_cpu()) {
      return "chunkmem copy engine: pair " + std::to_string(i) + " goes the wrong direction for this batch (" +
             (upload ? "cpu -> cuda:" : "cuda:") + std::to_string(device) + (upload ? "" : " -> cpu") +
             "); split batches by direction and device";
    }
    if (!dst[i].is_contiguous() || !src[i].is_contiguous()) {
      return "chunkmem copy engine: pair " + std::to_string(i) + " is not contiguous; chunks are flat buffers, "
             "pass them whole";
    }
    if (dst[i].nbytes() != src[i].nbytes() || dst[i].dtype() != src[i].dtype()) {
      return "chunkmem copy engine: pair " + std::to_string(i) + " has " + std::to_string(src[i].nbytes()) +
             " bytes for " + std::to_string(dst[i].nbytes()) + " bytes, or another dtype; both sides must match";
    }
  }
  return "";
}

// One per device and process (chunkmem/native.py caches it). The streams are never destroyed: the caching
// allocator records events on them for device buffers that may outlive the engine, until process exit.
class CopyEngine {
 public:
  explicit CopyEngine(int device) : device_(device) {
    DeviceGuard guard(static_cast<c10::DeviceIndex>(device));
    error_ = failure(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (h2d)");
    if (error_.empty()) {
      error_ = failure(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (d2h)");
    }
    if (error_.empty()) error_ = failure(cudaEventCreateWithFlags(&fence_, cudaEventDisableTiming), "cudaEventCreate");
  }
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  int device() const { return device_; }
  const std::string& error() const { return error_; }  // "" unless setting up the streams failed
  std::uintptr_t h2d_stream() const { return reinterpret_cast<std::uintptr_t>(h2d_); }
  std::uintptr_t d2h_stream() const { return reinterpret_cast<std::uintptr_t>(d2h_); }

  // Copies src[i] into dst[i] for every i, all in one direction (every dst on this device and every src
  // on the host, or the reverse), on that direction's stream, after the work already queued on `after`
  // (the stream that allocated or last wrote the buffers, as an integer). 0 is not "none": it is the
  // legacy default stream, PyTorch's compute stream unless the caller chose another, and the copy
  // streams are non-blocking, so they order against it only through this fence. Returns an event after
  // the last copy, or none and what was wrong (nothing is issued for a bad batch). The caller keeps the
  // tensors alive, and device buffers recorded on the copy stream, until it fires.
  std::pair<std::shared_ptr<Event>, std::string> copy(const std::vector<at::Tensor>& dst,
                                                      const std::vector<at::Tensor>& src, std::uintptr_t after) {
    // Errors are returned, never thrown: a C++ exception out of here ended the process on the lent H100's build.
    try {
      return copy_or_error(dst, src, after);
    } catch (const std::exception& caught) {
      return {nullptr, std::string("chunkmem copy engine: ") + caught.what()};
    }
  }

 private:
  std::pair<std::shared_ptr<Event>, std::string> copy_or_error(const std::vector<at::Tensor>& dst,
                                                               const std::vector<at::Tensor>& src,
                                                               std::uintptr_t after) {
    std::string error = error_.empty() ? invalid(dst, src, device_) : error_;
    if (!error.empty()) return {nullptr, error};
    const bool upload = dst[0].is_cuda();
    std::vector<void*> dst_ptrs(dst.size());
    std::vector<const void*> src_ptrs(src.size());
    std::vector<size_t> bytes(dst.size());
    for (size_t i = 0; i < dst.size(); ++i) {
      dst_ptrs[i] = dst[i].data_ptr();
      src_ptrs[i] = src[i].data_ptr();
      bytes[i] = dst[i].nbytes();
    }
    cudaStream_t stream = upload ? h2d_ : d2h_;
    auto done = std::make_shared<Event>(device_);
    pybind11::gil_scoped_release no_gil;  // a copy from pageable memory blocks until it is staged
    std::lock_guard<std::mutex> lock(mutex_);  // one fence event per engine
    DeviceGuard guard(static_cast<c10::DeviceIndex>(device_));
    // The wait binds to the record made just before it, so one reused event serves every call.
    error = failure(cudaEventRecord(fence_, reinterpret_cast<cudaStream_t>(after)), "cudaEventRecord (fence)");
    if (error.empty()) error = failure(cudaStreamWaitEvent(stream, fence_, 0), "cudaStreamWaitEvent (fence)");
    int issued = 0;
    if (error.empty()) {
      error = failure(chunkmem_copy_batch(dst_ptrs.data(), src_ptrs.data(), bytes.data(),
                                          static_cast<int>(bytes.size()),
                                          upload ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream, &issued),
                      "cudaMemcpyAsync");
    }
    if (error.empty()) error = done->record(stream);
    if (!error.empty()) {
      // Copies issued before the failure would go on reading or writing buffers nothing could wait for.
      (void)cudaStreamSynchronize(stream);
      (void)cudaGetLastError();
      return {nullptr, error};
    }
    return {done, ""};
  }

  int device_;
  std::string error_;
  cudaStream_t h2d_ = nullptr;
  cudaStream_t d2h_ = nullptr;
  cudaEvent_t fence_ = nullptr;
  std::mutex mutex_;
};

// How far the caching allocator's live bytes rose above where they are now, since the last reading, per device:
// the peak of the temporaries between two of chunkmem's moments (chunkmem/memory/gpu_memory.py), read without
// resetting PyTorch's own peak statistics, which belong to the user. Fed by the allocator's trace tracker, which it
// calls with its lock held for every allocation and completed free: a block stays live until a copy stream that
// used it is done (active bytes, as held_bytes counts them), not only until it is freed.
constexpr int kMaxDevices = 64;
std::array<std::atomic<long long>, kMaxDevices> allocated_now{};
std::array<std::atomic<long long>, kMaxDevices> allocated_peak{};
std::array<std::atomic<long long>, kMaxDevices> allocated_largest{};  // the largest block since the last reading

void track_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const auto& entry) {
      using Entry = std::decay_t<decltype(entry)>;
      const int device = static_cast<int>(entry.device_);
      if (device < 0 || device >= kMaxDevices) return;
      // The entry gives the size asked for; the block is that rounded up to 512 bytes (the allocator's kMinBlockSize,
      // without roundup_power2_divisions), as held_bytes and the simulation count it.
      const auto size = static_cast<long long>((entry.size_ + 511) / 512 * 512);
      if (entry.action_ == Entry::ALLOC) {
        const long long now = allocated_now[device].fetch_add(size) + size;
        long long peak = allocated_peak[device].load();
        while (now > peak && !allocated_peak[device].compare_exchange_weak(peak, now)) {
        }
        long long largest = allocated_largest[device].load();
        while (size > largest && !allocated_largest[device].compare_exchange_weak(largest, size)) {
        }
      } else if (entry.action_ == Entry::FREE_COMPLETED) {
        allocated_now[device].fetch_sub(size);
      }
    });
  });
}

// Bytes by which allocations on `device` peaked above their level now since the last call (0 if they did not),
// and the largest block allocated since; a new reading starts from now.
std::pair<long long, long long> take_allocation_reading(int device) {
  if (device < 0 || device >= kMaxDevices) return {0, 0};
  const long long now = allocated_now[device].load();
  const long long peak = allocated_peak[device].exchange(now);
  return {std::max(0LL, peak - now), allocated_largest[device].exchange(0)};
}

// What the caching allocator holds on `device` and would not give back at its cap (gpu_memory.held_bytes): its
// live blocks, those freed while another stream's copy may still use them (active, not allocated), and the free
// blocks inside split segments. A copy of the device's statistics under the allocator's lock, where
// torch.cuda.memory_stats builds a Python dictionary of every statistic, at every moment of a step.
long long held_bytes(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return stats.active_bytes[all].current + stats.inactive_split_bytes[all].current;
}

// (address, "") or (0, what failed): a refusal to pin is not fatal (hostpool.py falls back to pageable memory).
std::pair<std::uintptr_t, std::string> pinned_alloc(size_t bytes) {
  void* ptr = nullptr;
  const cudaError_t status = chunkmem_pinned_alloc(bytes, &ptr);
  if (status != cudaSuccess) {
    return {0, "chunkmem copy engine: cudaHostAlloc of " + std::to_string(bytes) + " bytes failed (" +
                   cudaGetErrorString(status) + "): free host memory, or pin less"};
  }
  return {reinterpret_cast<std::uintptr_t>(ptr), ""};
}

std::string pinned_free(std::uintptr_t ptr) { return failure(chunkmem_pinned_free(reinterpret_cast<void*>(ptr)), "cudaFreeHost"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "chunkmem's CUDA copy engine (csrc/copy_engine.cu); errors are returned, native.py raises them";
  pybind11::class_<Event, std::shared_ptr<Event>>(m, "Event")
      .def("wait", &Event::wait, pybind11::arg("stream"))
      .def("synchronize", &Event::synchronize)
      .def("query", &Event::query);
  pybind11::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def(pybind11::init<int>(), pybind11::arg("device"))
      .def_property_readonly("device", &CopyEngine::device)
      .def_property_readonly("error", &CopyEngine::error)
      .def_property_readonly("h2d_stream", &CopyEngine::h2d_stream)
      .def_property_readonly("d2h_stream", &CopyEngine::d2h_stream)
      .def("copy", &CopyEngine::copy, pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("after"));
  // cudaHostAlloc takes a while per GiB and cudaFreeHost waits for the device: the GIL is not held meanwhile (a pool's
  // finalizer may free blocks on any thread).
  m.def("pinned_alloc", &pinned_alloc, pybind11::arg("nbytes"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pinned_free", &pinned_free, pybind11::arg("ptr"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("track_allocations", &track_allocations);
  m.def("take_allocation_reading", &take_allocation_reading, pybind11::arg("device"));
  m.def("held_bytes", &held_bytes, pybind11::arg("device"));
}

#endif  // TORCH_EXTENSION_NAME
