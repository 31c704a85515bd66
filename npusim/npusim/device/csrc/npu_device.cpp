// The simulator's `npu` device: PrivateUse1 renamed `npu`, whose memory is host memory.
//
// Why a C++ backend: an `npu` tensor must have real storage and a real data pointer (aliases
// share it: torch_npu._C._weak_ref_tensor, vLLM's input-address check, graph pools and
// use-after-free detection all compare pointers), pinned host memory must be told apart by
// pointer, and every aten op must run with real math on that same memory.  torch's Python
// backend keeps a tensor's data outside its storage, so none of that holds there.
//
// What is here, and nothing else:
// * an allocator (host memory labelled npu:N) and a pinned host allocator, PrivateUse1's
//   device and host allocators as torch_npu's are;
// * the ops a backend must own: empty, empty_strided, as_strided, view, _reshape_alias,
//   resize_, set_, _copy_from, _copy_from_and_resize;
// * a boxed fallback for every other op: npu arguments become CPU tensors over the same
//   memory, the CPU kernel runs, and results come back as npu tensors (the argument itself
//   for in-place and out= ops, a view of it for views, the result's own memory otherwise:
//   nothing is copied);
// * a device guard (current device per thread; one default stream: the simulator's streams
//   live in Python) and the PrivateUse1 hooks (pinned memory, availability).
//
// Stream order, graph capture and kernel math stay in Python (npusim).

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>
#include <torch/version.h>

// torch's allocator interfaces for an accelerator, and the torch each needs: at::HostAllocator
// came in torch 2.8, and torch_npu's NPU allocator is a c10::DeviceAllocator from its release
// for torch 2.13 (a plain c10::Allocator before, which torch.accelerator's memory calls refuse)
#define NPUSIM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#define NPUSIM_HOST_ALLOCATOR NPUSIM_TORCH_AT_LEAST(2, 8)
#define NPUSIM_DEVICE_ALLOCATOR NPUSIM_TORCH_AT_LEAST(2, 13)
#if NPUSIM_HOST_ALLOCATOR
#include <ATen/core/CachingHostAllocator.h>
#endif
#if NPUSIM_DEVICE_ALLOCATOR
#include <c10/core/CachingDeviceAllocator.h>
#endif

#include <algorithm>
#include <atomic>
#include <map>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <pthread.h>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <unordered_map>
#include <unordered_set>

namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

c10::DeviceIndex device_count() {
  // torch_npu sees every card of the host; the simulator's cards share host memory, and
  // their number only labels tensors (vLLM gives each rank its own: npu:<local rank>).
  static const c10::DeviceIndex count = [] {
    const char* env = std::getenv("NPUGRAPH_SIM_DEVICES");
    int n = env ? std::atoi(env) : 8;
    return static_cast<c10::DeviceIndex>(n > 0 && n <= 64 ? n : 8);
  }();
  return count;
}

thread_local c10::DeviceIndex current_index = 0;

// ---- memory ---------------------------------------------------------------------------

// Live bytes per device (what torch.npu.memory_allocated reports), and the peak.
struct MemoryStats {
  std::mutex lock;
  // ordered by address: a pointer anywhere inside an allocation finds it (is_npu_memory)
  std::map<const void*, std::pair<c10::DeviceIndex, size_t>> sizes;
  int64_t allocated[64] = {};
  int64_t peak[64] = {};
  int64_t allocations[64] = {};
  int64_t frees[64] = {};
  int64_t capacity = 0;  // bytes of each card (0: no limit), set from Python at install
  bool used = false;     // torch_npu's allocator is initialized by the card's first use

  // `nbytes` more of card `dev`'s memory in use, one allocation more; the caller holds `lock`
  void count_in(c10::DeviceIndex dev, int64_t nbytes) {
    allocated[dev] += nbytes;
    allocations[dev] += 1;
    used = true;
    if (allocated[dev] > peak[dev]) {
      peak[dev] = allocated[dev];
    }
  }
};

// Allocations of this size or more ask the host whether it can back them (check_room) and
// are private anonymous mappings of their own (map_large).
constexpr int64_t kLargeFrom = 64ll << 20;

bool is_large(size_t nbytes) {
  return nbytes >= static_cast<size_t>(kLargeFrom);
}

MemoryStats& stats() {
  static MemoryStats* s = new MemoryStats();  // never destroyed: frees may come at exit
  return *s;
}

// The allocation whose bytes hold `p`, or `s.sizes.end()`; the caller holds `s.lock`.
std::map<const void*, std::pair<c10::DeviceIndex, size_t>>::iterator allocation_holding(MemoryStats& s,
                                                                                        const char* p) {
  auto it = s.sizes.upper_bound(p);
  if (it == s.sizes.begin()) {
    return s.sizes.end();
  }
  --it;
  return p < static_cast<const char*>(it->first) + it->second.second ? it : s.sizes.end();
}

void npu_free(void* p) {
  if (p == nullptr) {
    return;
  }
  size_t nbytes = 0;
  {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    auto it = s.sizes.find(p);
    if (it != s.sizes.end()) {
      nbytes = it->second.second;
      s.allocated[it->second.first] -= static_cast<int64_t>(nbytes);
      s.frees[it->second.first] += 1;
      s.sizes.erase(it);
    }
  }
  if (is_large(nbytes)) {
    munmap(p, nbytes);
  } else {
    c10::free_cpu(p);
  }
}

// A large allocation (a KV cache: gigabytes) is a private anonymous mapping of its own, so
// that zeroing it need not touch every page (zero_large): the kernel gives a page it has
// not backed yet, or one given back with MADV_DONTNEED, as zeros when it is first touched.
// vLLM and SGLang zero their KV caches at start-up; writing 10 GiB page by page took half a
// minute of every engine's start on the simulator, and committed host memory a card holds.
void* map_large(size_t nbytes) {
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED, "NPU out of memory: the host refused a mapping of ",
                   nbytes, " bytes for npugraph's simulated card");
  return p;
}

// Zero [p, p + nbytes) if it lies inside one large allocation: the whole pages inside it
// are given back (they read as zeros from then on), the partial pages at its ends written.
// Returns false where it does not (the caller zeroes as any op does).
bool zero_large(char* p, size_t nbytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (nbytes < 2 * page) {
    return false;
  }
  {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    auto it = allocation_holding(s, p);
    if (it == s.sizes.end() || !is_large(it->second.second) ||
        p + nbytes > static_cast<const char*>(it->first) + it->second.second) {
      return false;
    }
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + nbytes) / page * page;
  std::memset(p, 0, first - begin);
  std::memset(reinterpret_cast<char*>(last), 0, begin + nbytes - last);
  if (madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    std::memset(reinterpret_cast<char*>(first), 0, last - first);
  }
  return true;
}

// What the host has available (MemAvailable, bytes), or -1 where it cannot tell.
int64_t host_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) {
    return -1;
  }
  char line[256];
  long long kb = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lld kB", &kb) == 1) {
      break;
    }
  }
  std::fclose(f);
  return kb < 0 ? -1 : static_cast<int64_t>(kb) * 1024;
}

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1ll << 30));
  return buf;
}

// An allocation past the card's size is the device's out-of-memory error, as on a card.  One
// the host cannot back is refused too: the host overcommits, so it would succeed here and
// the kernel would kill the process when its pages are touched, with no message.
constexpr int64_t kHostReserve = 512ll << 20;  // left to the process's own work

void check_room(c10::DeviceIndex dev, int64_t nbytes, bool ask_host = true) {
  int64_t capacity = 0;
  int64_t used = 0;
  {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    capacity = s.capacity;
    used = s.allocated[dev];
  }
  TORCH_CHECK_WITH(OutOfMemoryError, capacity <= 0 || used + nbytes <= capacity,
                   "NPU out of memory. Tried to allocate ", gib(nbytes), " on npu:", static_cast<int>(dev),
                   ", which has ", gib(capacity), " in total and ", gib(used),
                   " allocated. npugraph's simulated card is host memory; its size is NPUGRAPH_SIM_MEMORY_GB "
                   "(default: half the memory the host had available when the process started).");
  if (!ask_host || !is_large(static_cast<size_t>(nbytes))) {
    return;
  }
  const int64_t available = host_available();
  TORCH_CHECK_WITH(OutOfMemoryError, available < 0 || nbytes + kHostReserve <= available,
                   "NPU out of memory. Tried to allocate ", gib(nbytes), " on npu:", static_cast<int>(dev),
                   ", but the host, whose memory backs npugraph's simulated card, has only ", gib(available),
                   " available: the kernel would kill the process. Set NPUGRAPH_SIM_MEMORY_GB lower (the card "
                   "has ",
                   gib(capacity), ") or ask for less memory (vLLM: gpu_memory_utilization).");
}

#if NPUSIM_DEVICE_ALLOCATOR
using NpuAllocatorBase = c10::DeviceAllocator;
#else
using NpuAllocatorBase = c10::Allocator;
#endif

// PrivateUse1's allocator, as torch_npu's caching allocator is: torch.accelerator's memory
// calls (empty_cache, memory_allocated, get_memory_info: vLLM's profiling and shutdown) and
// storages made from the device type (torch.UntypedStorage(n, device="npu")) reach it there.
struct NpuAllocator final : NpuAllocatorBase {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex dev = current_index;
    check_room(dev, static_cast<int64_t>(nbytes));
    void* p = is_large(nbytes) ? map_large(nbytes) : nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (p != nullptr) {
      MemoryStats& s = stats();
      std::lock_guard<std::mutex> g(s.lock);
      s.sizes[p] = {dev, nbytes};
      s.count_in(dev, static_cast<int64_t>(nbytes));
    }
    return {p, p, &npu_free, c10::Device(kNpu, dev)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &npu_free;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

#if NPUSIM_DEVICE_ALLOCATOR
  bool initialized() override {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    return s.used;
  }
  // Freed memory goes back to the host at once: there is no cache to empty, and no block
  // waits for a stream before it is reused (the simulator's stream order is in Python).
  void emptyCache(c10::MempoolId_t /*mempool_id*/ = {0, 0}) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  // What torch_npu reports, from the counters torch.npu.memory_stats reads: with nothing
  // cached, reserved and active are what is allocated; the pools are not told apart, and
  // counts keep no peak of their own.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const c10::DeviceIndex dev = checked(device);
    c10::CachingDeviceAllocator::DeviceStats d;
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* bytes : {&d.allocated_bytes, &d.reserved_bytes, &d.active_bytes, &d.requested_bytes}) {
      (*bytes)[all].current = s.allocated[dev];
      (*bytes)[all].peak = s.peak[dev];
    }
    for (auto* count : {&d.allocation, &d.segment, &d.active}) {
      (*count)[all].current = s.allocations[dev] - s.frees[dev];
      (*count)[all].peak = (*count)[all].current;
      (*count)[all].allocated = s.allocations[dev];
      (*count)[all].freed = s.frees[dev];
    }
    d.num_device_alloc = s.allocations[dev];
    d.num_device_free = s.frees[dev];
    return d;
  }
  // the allocations still live stay counted: the current count is allocations less frees
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    const c10::DeviceIndex dev = checked(device);
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    s.allocations[dev] -= s.frees[dev];
    s.frees[dev] = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    const c10::DeviceIndex dev = checked(device);
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    s.peak[dev] = s.allocated[dev];
  }
  // (free, total) as torch.npu.mem_get_info says them: the card's size less what is allocated
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    const c10::DeviceIndex dev = checked(device);
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    const int64_t free = std::max<int64_t>(0, s.capacity - s.allocated[dev]);
    return {static_cast<size_t>(free), static_cast<size_t>(s.capacity)};
  }

 private:
  static c10::DeviceIndex checked(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < device_count(), "npu:", static_cast<int>(device),
                " is not a device of the simulator (it has ", static_cast<int>(device_count()),
                "; NPUGRAPH_SIM_DEVICES sets how many)");
    return device;
  }
#endif
};

// never destroyed: as PrivateUse1's allocator, torch may still ask for it at exit
NpuAllocator& npu_allocator = *new NpuAllocator();

#if NPUSIM_HOST_ALLOCATOR
using PinnedAllocatorBase = at::HostAllocator;
#else
using PinnedAllocatorBase = c10::Allocator;
#endif

// Page-locked host memory: what Tensor.pin_memory() gives on Ascend.  A CPU cannot pin, so
// the allocator remembers its pointers: is_pinned() asks it.  From torch 2.8 it is also
// PrivateUse1's host allocator, as torch_npu's caching host allocator is: with none, torch
// dereferences a null one in torch.accelerator.empty_host_cache() (vLLM's shutdown).
struct PinnedAllocator final : PinnedAllocatorBase {
  std::mutex lock;
  std::unordered_map<void*, size_t> live;  // the bytes of each
#if NPUSIM_HOST_ALLOCATOR
  c10::CachingAllocator::Stat requests;
  c10::CachingAllocator::Stat bytes;
#endif

  static void release(void* p);

  // the host allocator's stats: `nbytes` more (`in`) or fewer pinned; the caller holds `lock`
  void count([[maybe_unused]] size_t nbytes, [[maybe_unused]] bool in) {
#if NPUSIM_HOST_ALLOCATOR
    if (in) {
      requests.increase(1);
      bytes.increase(nbytes);
    } else {
      requests.decrease(1);
      bytes.decrease(nbytes);
    }
#endif
  }

  c10::DataPtr allocate(size_t nbytes) override {
    void* p = c10::alloc_cpu(nbytes ? nbytes : 1);
    {
      std::lock_guard<std::mutex> g(lock);
      live.emplace(p, nbytes);
      count(nbytes, true);
    }
    return {p, p, &PinnedAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &PinnedAllocator::release;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool pinned(const void* p) {
    std::lock_guard<std::mutex> g(lock);
    return live.count(const_cast<void*>(p)) != 0;
  }

#if NPUSIM_HOST_ALLOCATOR
  // Freed pinned memory goes back to the host at once: no block waits for a stream's copy
  // before it is reused, and there is no cache to empty.
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override {
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> g(lock);
    at::HostStats s;
    s.allocated_bytes = bytes;  // a field of HostStats in every torch that has it
    s.num_host_alloc = requests.allocated;
    s.num_host_free = requests.freed;
#if NPUSIM_TORCH_AT_LEAST(2, 13)  // torch 2.8's stats had other fields
    s.active_requests = requests;
    s.active_bytes = bytes;
    s.allocations = requests;
#endif
    return s;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> g(lock);
    requests.reset_accumulated();
    bytes.reset_accumulated();
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> g(lock);
    requests.reset_peak();
    bytes.reset_peak();
  }
#endif
};

PinnedAllocator& pinned_allocator() {
  static PinnedAllocator* a = new PinnedAllocator();  // never destroyed: frees may come at exit
  return *a;
}

void PinnedAllocator::release(void* p) {
  PinnedAllocator& a = pinned_allocator();
  {
    std::lock_guard<std::mutex> g(a.lock);
    auto it = a.live.find(p);
    if (it != a.live.end()) {
      a.count(it->second, false);
      a.live.erase(it);
    }
  }
  c10::free_cpu(p);
}

bool register_allocators() {
  c10::SetAllocator(kNpu, &npu_allocator);
#if NPUSIM_HOST_ALLOCATOR
  at::setHostAllocator(kNpu, &pinned_allocator());
#endif
  return true;
}

const bool allocators_registered = register_allocators();

// ---- tensors over the same memory -----------------------------------------------------

// What a storage over another storage's bytes holds: that storage, and whether its bytes
// count as the npu device's (a kernel result handed over as npu memory).
struct Kept {
  c10::Storage storage;
  c10::DeviceIndex dev;
  int64_t counted;
};

void release_kept(void* ctx) {
  auto* kept = static_cast<Kept*>(ctx);
  if (kept->counted) {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    s.allocated[kept->dev] -= kept->counted;
    s.frees[kept->dev] += 1;
  }
  delete kept;
}

// A storage over the bytes of `src` labelled `device`, which keeps `src` alive; bytes that
// become npu memory here are counted as the device's.  Resizing it (an out= argument a
// kernel grows) moves it to new memory from `allocator`.
// Whether `src`'s bytes are npu memory: an npu storage, or a host view of one (what the
// kernels and the fallback compute on), however many views deep.
bool is_npu_memory(const c10::Storage& src) {
  if (src.device().type() == kNpu) {
    return true;
  }
  const c10::DataPtr& ptr = src.data_ptr();
  if (ptr.get_deleter() == &release_kept) {
    return is_npu_memory(static_cast<Kept*>(ptr.get_context())->storage);
  }
  // a host buffer over an npu allocation's bytes (the simulator's non-owning aliases are
  // made from the address): inside an allocation the npu allocator made
  const auto* p = static_cast<const char*>(src.data());
  if (p == nullptr) {
    return false;
  }
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  return allocation_holding(s, p) != s.sizes.end();
}

c10::Storage storage_over(const c10::Storage& src, c10::Device device, c10::Allocator* allocator) {
  // an npu view of a host view of npu memory is the same memory: counting it again made an
  // alias (torch_npu._C._weak_ref_tensor of a KV cache) look like a second cache
  const bool becomes_npu = device.type() == kNpu && !is_npu_memory(src);
  const int64_t nbytes = becomes_npu ? static_cast<int64_t>(src.nbytes()) : 0;
  if (nbytes) {
    // host memory an op's CPU kernel made, becoming the card's: past the card, its OOM error
    // (the host has it already, so only the card is asked)
    check_room(device.index(), nbytes, /*ask_host=*/false);
  }
  auto* keep = new Kept{src, device.type() == kNpu ? device.index() : c10::DeviceIndex(0), nbytes};
  if (nbytes) {
    MemoryStats& s = stats();
    std::lock_guard<std::mutex> g(s.lock);
    s.count_in(keep->dev, nbytes);
  }
  c10::DataPtr ptr(const_cast<void*>(src.data()), keep, &release_kept, device);
  return c10::Storage(c10::Storage::use_byte_size_t(), src.nbytes(), std::move(ptr), allocator,
                      /*resizable=*/true);
}

// A tensor over the bytes of `t` (same pointer, sizes, strides, offset) on `device`, whose
// storage keeps `t`'s storage alive.
at::Tensor same_memory(const at::Tensor& t, c10::Device device, c10::Allocator* allocator) {
  c10::Storage storage = storage_over(t.storage(), device, allocator);
  c10::DispatchKeySet keys = device.type() == kNpu ? c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)
                                                   : c10::DispatchKeySet(c10::DispatchKey::CPU);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

// The device's compute is this host's OpenMP pool, which does not survive a fork: in a
// child whose parent ran a parallel region, any region of more than one thread waits in
// libgomp forever for the parent's workers.  The child is set to one thread at the fork
// (backend.py), but a library may raise the count again later (vLLM's n-gram proposer
// restores numba's thread count through the same libgomp, to the host's cores): so in a
// forked child every device op, and every CPU view a kernel computes on, first puts it back.
std::atomic<bool> forked_child{false};

void note_fork() {
  forked_child.store(true, std::memory_order_relaxed);
}

bool register_fork_handler() {
  pthread_atfork(nullptr, nullptr, note_fork);
  return true;
}

const bool fork_handler_registered = register_fork_handler();

void one_thread_if_forked() {
  if (forked_child.load(std::memory_order_relaxed) && at::get_num_threads() > 1) {
    at::set_num_threads(1);
  }
}

// The CPU tensor over an npu tensor's memory (host memory: the CPU kernels run on it).
at::Tensor host_view(const at::Tensor& t) {
  one_thread_if_forked();
  if (!t.defined() || t.device().type() != kNpu) {
    return t;
  }
  return same_memory(t, c10::Device(c10::DeviceType::CPU), c10::GetDefaultCPUAllocator());
}

// ---- the ops a backend owns -----------------------------------------------------------

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    TORCH_CHECK(device->index() < device_count(), "npu:", static_cast<int>(device->index()),
                " is not a device of the simulator (it has ", static_cast<int>(device_count()),
                "; NPUGRAPH_SIM_DEVICES sets how many)");
    return device->index();
  }
  return current_index;
}

struct IndexScope {
  c10::DeviceIndex saved;
  explicit IndexScope(c10::DeviceIndex i) : saved(current_index) {
    current_index = i;
  }
  ~IndexScope() {
    current_index = saved;
  }
};

at::Tensor npu_empty(at::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> pin_memory,
                     std::optional<at::MemoryFormat> memory_format) {
  IndexScope scope(index_of(device));
  return at::detail::empty_generic(size, &npu_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor npu_empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout> layout, std::optional<at::Device> device,
                             std::optional<bool> pin_memory) {
  IndexScope scope(index_of(device));
  return at::detail::empty_strided_generic(size, stride, &npu_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor& npu_set_storage(at::Tensor& self, c10::Storage source, int64_t offset, at::IntArrayRef size,
                            at::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& npu_set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return at::native::set_storage_cpu_(self, std::move(source), 0, {numel}, {});
}

at::Tensor& npu_set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_storage_cpu_(self, source.storage(), source.storage_offset(), source.sizes(),
                                      source.strides());
}

at::Tensor& npu_set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &npu_allocator, /*resizable=*/true);
  return at::native::set_storage_cpu_(self, std::move(storage), 0, {0}, {});
}

const at::Tensor& npu_resize(const at::Tensor& self, at::IntArrayRef size,
                             std::optional<at::MemoryFormat> memory_format) {
  IndexScope scope(self.device().index());
  return at::native::resize_(self, size, memory_format);
}

void check_same_kind(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.device().type() == kNpu || src.device().type() == c10::DeviceType::CPU,
              "copy between npu and ", src.device(), " is not supported by the simulator");
  TORCH_CHECK(dst.device().type() == kNpu || dst.device().type() == c10::DeviceType::CPU,
              "copy between npu and ", dst.device(), " is not supported by the simulator");
}

at::Tensor npu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  check_same_kind(self, dst);
  at::Tensor target = host_view(dst);
  target.copy_(host_view(self));
  return dst;
}

at::Tensor npu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return npu_copy_from(self, dst, false);
}

// ---- every other op: the CPU kernel, on the same memory -------------------------------

struct Swapped {
  at::Tensor npu;   // the argument as given
  at::Tensor host;  // the CPU tensor over its memory that the CPU kernel sees
};

bool is_npu(const at::Tensor& t) {
  return t.defined() && t.device().type() == kNpu;
}

// Ops whose index tensors may be host tensors beside device tensors (their indices, a
// list argument): every other CPU operand beside an npu one (not a 0-d scalar) is refused,
// as torch_npu refuses it.
bool allows_host_indices(const std::string& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put",
  };
  return ops.count(name) != 0;
}

at::Tensor back_to_npu(const at::Tensor& r, const std::vector<Swapped>& swapped, c10::DeviceIndex dev) {
  if (!r.defined() || r.device().type() != c10::DeviceType::CPU) {
    return r;
  }
  for (const Swapped& s : swapped) {
    if (r.unsafeGetTensorImpl() == s.host.unsafeGetTensorImpl()) {
      return s.npu;  // in place, or out=: the argument itself
    }
  }
  for (const Swapped& s : swapped) {
    if (r.storage().unsafeGetStorageImpl() == s.host.storage().unsafeGetStorageImpl()) {
      // a view of an argument: the same view of the npu tensor
      auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(s.npu.storage()),
                                                          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                          r.dtype());
      out.unsafeGetTensorImpl()->set_sizes_and_strides(r.sizes(), r.strides(), r.storage_offset());
      return out;
    }
  }
  return same_memory(r, c10::Device(kNpu, dev), &npu_allocator);  // a new result: its own memory
}

void npu_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  one_thread_if_forked();
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  if (nargs == 1 && schema.operator_name().name == "aten::zero_" && (*stack)[first].isTensor()) {
    const at::Tensor& t = (*stack)[first].toTensor();
    if (is_npu(t) && t.is_contiguous() && zero_large(static_cast<char*>(t.data_ptr()), t.nbytes())) {
      return;  // the argument stays on the stack: zero_ returns it
    }
  }
  std::vector<Swapped> swapped;
  std::optional<c10::DeviceIndex> dev;
  bool host_operand = false;  // a CPU tensor (not a 0-d scalar) passed as a tensor argument
  bool host_index = false;    // one inside a tensor-list argument (the indices of index ops)
  auto swap = [&](const at::Tensor& t, bool in_list) -> at::Tensor {
    if (is_npu(t)) {
      if (!dev.has_value()) {
        dev = t.device().index();
      }
      at::Tensor h = host_view(t);
      swapped.push_back({t, h});
      return h;
    }
    if (t.defined() && t.device().type() == c10::DeviceType::CPU && t.dim() > 0) {
      (in_list ? host_index : host_operand) = true;
    }
    return t;
  };
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = swap(v.toTensor(), false);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) {
        list.set(k, swap(list.get(k), true));
      }
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t k = 0; k < list.size(); ++k) {
        std::optional<at::Tensor> t = list.get(k);
        if (t.has_value()) {
          list.set(k, swap(*t, true));
        }
      }
    } else if (v.isDevice() && v.toDevice().type() == kNpu) {
      // a factory op made on npu: made on the CPU, then handed over as npu memory
      dev = v.toDevice().has_index() ? v.toDevice().index() : current_index;
      v = c10::IValue(c10::Device(c10::DeviceType::CPU));
    }
  }
  const std::string name = schema.operator_name().name;
  TORCH_CHECK(swapped.empty() || !(host_operand || (host_index && !allows_host_indices(name))),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              swapped.front().npu.device(), " and cpu! (", name, ")");
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  if (!dev.has_value()) {
    return;  // nothing of npu went in
  }
  for (const Swapped& s : swapped) {
    // an out= argument the kernel resized: the npu tensor takes the new shape (and memory)
    c10::TensorImpl* npu = s.npu.unsafeGetTensorImpl();
    if (s.host.storage().data() != s.npu.storage().data()) {
      npu->set_storage_keep_dtype(storage_over(s.host.storage(), s.npu.device(), &npu_allocator));
    }
    if (s.host.sizes() != s.npu.sizes() || s.host.strides() != s.npu.strides() ||
        s.host.storage_offset() != s.npu.storage_offset()) {
      npu->set_sizes_and_strides(s.host.sizes(), s.host.strides(), s.host.storage_offset());
    }
  }
  const size_t nrets = schema.returns().size();
  const size_t rfirst = stack->size() - nrets;
  for (size_t i = rfirst; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = back_to_npu(v.toTensor(), swapped, *dev);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t k = 0; k < list.size(); ++k) {
        list.set(k, back_to_npu(list.get(k), swapped, *dev));
      }
    }
  }
}

// ---- device guard and hooks -----------------------------------------------------------

struct NpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kNpu;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(kNpu, current_index);
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kNpu, "not an npu device: ", d);
    current_index = index_of(d);
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) {
      current_index = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }
  // torch.accelerator.synchronize() (vLLM's capture_model calls it): the simulator's
  // streams live in Python, which implements this op (npusim.device.backend.install)
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("npugraph_sim::synchronize_device", "")
                         .typed<void(int64_t)>();
    op.call(static_cast<int64_t>(index));
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuard);

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  bool isPinnedPtr(const void* data) const override {
    return pinned_allocator().pinned(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator();
  }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(kNpu, current_index);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    // random ops on npu run the CPU kernels with the CPU generator
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    // torch.Generator(device="npu") (vLLM's dummy weights seed one per parameter): a CPU
    // generator, which the CPU kernels behind npu ops accept; its .device says cpu
    return at::make_generator<at::CPUGeneratorImpl>();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

bool register_hooks() {
  static NpuHooks* hooks = new NpuHooks();
  at::RegisterPrivateUse1HooksInterface(hooks);
  return true;
}

const bool hooks_registered = register_hooks();

// ---- what Python asks ------------------------------------------------------------------

at::Tensor host_view_op(const at::Tensor& t) {
  TORCH_CHECK(is_npu(t), "host_view takes an npu tensor, got one on ", t.device());
  return host_view(t);
}

at::Tensor device_view_op(const at::Tensor& t, int64_t index) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::CPU, "device_view takes a CPU tensor, got one on ",
              t.device());
  return same_memory(t, c10::Device(kNpu, static_cast<c10::DeviceIndex>(index)), &npu_allocator);
}

std::vector<int64_t> memory_stats_op(int64_t index) {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  return {s.allocated[index], s.peak[index], s.allocations[index], s.frees[index]};
}

void set_capacity_op(int64_t bytes) {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  s.capacity = bytes;
}

int64_t capacity_op() {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  return s.capacity;
}

void reset_peak_op(int64_t index) {
  MemoryStats& s = stats();
  std::lock_guard<std::mutex> g(s.lock);
  s.peak[index] = s.allocated[index];
}

int64_t current_device_op() {
  return current_index;
}

void set_device_op(int64_t index) {
  current_index = index_of(c10::Device(kNpu, static_cast<c10::DeviceIndex>(index)));
}

int64_t device_count_op() {
  return device_count();
}

// torch_npu's rule for `tensor.data = other` (Variable::set_data): an npu and a CPU tensor
// may take each other's TensorImpl, as two CPU tensors may (stock torch lists only its own
// dense backends, so moving a CPU parameter's data to npu would be refused)
bool npu_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](c10::DispatchKeySet ks) {
    return ks.has(c10::DispatchKey::CPU) || ks.has(c10::DispatchKey::PrivateUse1);
  };
  return self.key_set() == from.key_set() || (dense(self.key_set()) && dense(from.key_set()));
}

}  // namespace

TORCH_LIBRARY(npugraph_sim, m) {
  m.def("host_view(Tensor(a) t) -> Tensor(a)", host_view_op);
  m.def("device_view(Tensor(a) t, int index) -> Tensor(a)", device_view_op);
  m.def("memory_stats(int index) -> int[]", memory_stats_op);
  m.def("reset_peak(int index) -> ()", reset_peak_op);
  m.def("set_capacity(int bytes) -> ()", set_capacity_op);
  m.def("capacity() -> int", capacity_op);
  m.def("current_device() -> int", current_device_op);
  m.def("set_device(int index) -> ()", set_device_op);
  m.def("device_count() -> int", device_count_op);
  m.def("one_thread_if_forked() -> ()", one_thread_if_forked);
  m.def("synchronize_device(int index) -> ()");  // implemented in Python: the streams are there
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", npu_empty);
  m.impl("empty_strided", npu_empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", npu_resize);
  m.impl("set_.source_Storage_storage_offset", npu_set_storage);
  m.impl("set_.source_Storage", npu_set_source_storage);
  m.impl("set_.source_Tensor", npu_set_source_tensor);
  m.impl("set_", npu_set_empty);
  m.impl("_copy_from", npu_copy_from);
  m.impl("_copy_from_and_resize", npu_copy_from_and_resize);
}

TORCH_LIBRARY_IMPL(aten, CatchAll, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(npu_has_compatible_shallow_copy_type));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}
