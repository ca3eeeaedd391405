// SPDX-License-Identifier: MIT
// The metal backend: see include/residency/backends/metal.hpp for what and why.
//
// Object ownership follows Cocoa's rules through NS::SharedPtr: new*/alloc+init results are
// owned (TransferPtr), everything else is retained when kept (RetainPtr). Every entry point
// runs inside an autorelease pool, because the manager calls some of them from its scheduler
// thread, which has none. The manager serialises its calls, but an engine calls
// add_command_queue / remove_command_queue from its own threads, so every entry point takes the
// backend's mutex (uncontended in the common case: one atomic operation).
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include "backends/metal/metal_util.hpp"

#if !__has_include(<Metal/MTLResidencySet.hpp>)
#error \
    "RESIDENCY_METAL_CPP_DIR points at metal-cpp without Metal/MTLResidencySet.hpp: use metal-cpp for macOS 15 / iOS 18 or later"
#endif

#include <TargetConditionals.h>
#include <objc/runtime.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backends/metal/pressure_source.hpp"
#include "platform/thread_annotations.hpp"
#include "residency/backends/metal.hpp"
#include "residency/config.hpp"
#include "residency/text.hpp"
#include "residency/view_planner.hpp"

namespace residency {
namespace {

using namespace std::chrono_literals;
using metal::describe;

// From macOS 26 a residency request decays about 1 s after use unless repeated (llama.cpp
// added its heartbeat for it); half the decay, as llama.cpp's heartbeat period was until
// mid-2026, so that one late refresh never lets a request lapse.
constexpr Nanos kRefreshPeriod = 500ms;
constexpr NS::Integer kDecayingRequestsFromMacOS = 26;

bool os_at_least(NS::Integer major) {
  NS::OperatingSystemVersion v{major, 0, 0};
  return NS::ProcessInfo::processInfo()->isOperatingSystemAtLeastVersion(v);
}

std::string os_version() {
  const NS::OperatingSystemVersion v = NS::ProcessInfo::processInfo()->operatingSystemVersion();
  return std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion);
}

// The OS release from which MTLResidencySet exists, and the platform's name.
struct Platform {
  const char* name;
  NS::Integer residency_sets_from;
};
constexpr Platform platform() {
#if defined(TARGET_OS_VISION) && TARGET_OS_VISION
  return {"visionOS", 2};
#elif defined(TARGET_OS_TV) && TARGET_OS_TV
  return {"tvOS", 18};
#elif defined(TARGET_OS_IPHONE) && TARGET_OS_IPHONE
  return {"iOS", 18};
#else
  return {"macOS", 15};
#endif
}

// An NS::Array (of the views an engine made of one mapping) rather than one MTL::Allocation:
// arrays answer objectAtIndex:, allocations do not.
bool is_array(const void* object) {
  Class cls = object_getClass(static_cast<id>(const_cast<void*>(object)));
  return cls != nullptr && class_respondsToSelector(cls, sel_registerName("objectAtIndex:"));
}

MetalSupport support_of(MTL::Device* device) {
  const Platform p = platform();
  if (!os_at_least(p.residency_sets_from)) {
    return {false, std::string(p.name) + " " + os_version() + " has no MTLResidencySet (needs " + p.name + " " +
                       std::to_string(p.residency_sets_from) + " or later)"};
  }
  if (device == nullptr) return {false, "no Metal device (MTLCreateSystemDefaultDevice returned nil)"};
  if (!device->supportsFamily(MTL::GPUFamilyMetal3)) {
    return {false,
            std::string("the GPU (") + device->name()->utf8String() + ") is not in the MTLGPUFamilyMetal3 family"};
  }
  return {true, ""};
}

// A shared-storage buffer over `length` bytes at `base` (page-aligned), without copying and
// without owning them. The overload with a deallocator is newBufferWithBytesNoCopy; none: the
// memory stays the caller's.
MTL::Buffer* no_copy_buffer(MTL::Device* device, std::uintptr_t base, std::uint64_t length) {
  using Deallocator = void (^)(void*, NS::UInteger);
  const Deallocator keep_memory = nullptr;
  return device->newBuffer(reinterpret_cast<const void*>(base), static_cast<NS::UInteger>(length),
                           MTL::ResourceStorageModeShared, keep_memory);
}

}  // namespace

struct MetalBackend::Impl {
  // A region as the set holds it: the allocations added for it (the engine's MTL::Buffer, or
  // the no-copy views this backend made of host memory).
  struct Member {
    RegionDesc desc;
    std::vector<NS::SharedPtr<MTL::Allocation>> allocations;
  };
  struct Set {
    NS::SharedPtr<MTL::ResidencySet> set;
    std::map<RegionId, Member> members;
    std::map<RegionId, RegionDesc> staged_add;
    std::set<RegionId> staged_remove;
    bool requested = false;
  };

  MetalOptions options;
  NS::SharedPtr<MTL::Device> device;
  NS::SharedPtr<MTL::CommandQueue> own_queue;  // for the 1-byte blit
  NS::SharedPtr<MTL::Buffer> blit_target;
  bool gpu_work_done = false;  // the blit completed: ended residency will be given back
  bool refresh = false;
  std::uint64_t page = 0;
  std::uint64_t max_view = 0;  // maxBufferLength rounded down to a page
  Mutex mu;                    // guards sets and queues
  std::map<SetId, Set> sets RESIDENCY_GUARDED_BY(mu);
  std::vector<NS::SharedPtr<MTL::CommandQueue>> queues RESIDENCY_GUARDED_BY(mu);

  // The pressure watch: one source, a watcher per manager. Lock order: watch_mu, then
  // watchers_mu (held while the watchers run, on the source's queue); never `mu` with either.
  Mutex watch_mu;
  metal::PressureSource pressure RESIDENCY_GUARDED_BY(watch_mu);
  Mutex watchers_mu;
  std::map<PressureWatchId, std::function<void()>> watchers RESIDENCY_GUARDED_BY(watchers_mu);
  PressureWatchId next_watch_id RESIDENCY_GUARDED_BY(watchers_mu) = 1;

  // One tiny GPU operation: fill one byte of a private buffer and wait for it. Returns why it
  // failed, or "".
  std::string blit() {
    if (!own_queue) own_queue = NS::TransferPtr(device->newCommandQueue());
    if (!blit_target) blit_target = NS::TransferPtr(device->newBuffer(1, MTL::ResourceStorageModePrivate));
    if (!own_queue || !blit_target) return "could not create a command queue or a 1-byte buffer";
    MTL::CommandBuffer* cb = own_queue->commandBuffer();
    if (cb == nullptr) return "could not create a command buffer";
    MTL::BlitCommandEncoder* enc = cb->blitCommandEncoder();
    if (enc == nullptr) return "could not create a blit encoder";
    enc->fillBuffer(blit_target.get(), NS::Range::Make(0, 1), 0);
    enc->endEncoding();
    cb->commit();
    cb->waitUntilCompleted();
    if (cb->status() == MTL::CommandBufferStatusError) return describe(cb->error());
    gpu_work_done = true;
    return "";
  }

  // Wraps host memory in no-copy shared buffers, split into views when longer than
  // maxBufferLength. The region must start on a page (newBufferWithBytesNoCopy's rule).
  Status wrap(const RegionDesc& d, std::vector<NS::SharedPtr<MTL::Allocation>>& out) {
    const auto base = reinterpret_cast<std::uintptr_t>(d.base);
    if (base % page != 0) {
      return Status(ErrorCode::invalid_argument,
                    "metal: region " + std::to_string(d.id) + " does not start on a page (" + std::to_string(page) +
                        " bytes); no-copy buffers need page-aligned memory (mmap it, or allocate "
                        "with posix_memalign)");
    }
    const std::uint64_t size = (d.size + page - 1) / page * page;
    auto views = plan_views(size, max_view, page, {}, kMetalMaxViews);
    if (!views) return Status(views.status().code(), "metal: region " + std::to_string(d.id) + ": " + views.message());
    for (const View& v : *views) {
      MTL::Buffer* b = no_copy_buffer(device.get(), base + v.offset, v.length);
      if (b == nullptr) {
        out.clear();
        return Status(ErrorCode::backend_error, "metal: newBufferWithBytesNoCopy failed for " + format_size(v.length) +
                                                    " at offset " + std::to_string(v.offset) + " of region " +
                                                    std::to_string(d.id));
      }
      out.push_back(NS::TransferPtr(static_cast<MTL::Allocation*>(b)));
    }
    return Status::ok();
  }

  // The allocations a region's backend object stands for: itself, or each element of an array.
  static Status allocations_of(const RegionDesc& d, std::vector<NS::SharedPtr<MTL::Allocation>>& out) {
    if (!is_array(d.backend_object)) {
      out.push_back(NS::RetainPtr(static_cast<MTL::Allocation*>(d.backend_object)));
      return Status::ok();
    }
    const auto* array = static_cast<const NS::Array*>(d.backend_object);
    for (NS::UInteger i = 0; i < array->count(); ++i) {
      out.push_back(NS::RetainPtr(array->object<MTL::Allocation>(i)));
    }
    if (out.empty()) {
      return Status(ErrorCode::invalid_argument,
                    "metal: region " + std::to_string(d.id) + " was registered with an empty NS::Array");
    }
    return Status::ok();
  }

  // The free sequence: endResidency -> removeAllAllocations -> commit -> release (and off
  // every queue first, so that no queue keeps it alive).
  void destroy(std::map<SetId, Set>::iterator it) RESIDENCY_REQUIRES(mu) {
    MTL::ResidencySet* rs = it->second.set.get();
    if (options.attach_to_queues) {
      for (auto& q : queues) q->removeResidencySet(rs);
    }
    if (it->second.requested) rs->endResidency();
    rs->removeAllAllocations();
    rs->commit();
    sets.erase(it);  // releases the set and the views made for its regions
  }

  static Status queue_limit_error(std::size_t attached) {
    return Status(ErrorCode::limit_exceeded,
                  "metal: every residency set is attached to every registered command queue, and "
                  "a queue accepts at most " +
                      std::to_string(kMetalMaxSetsPerQueue) + " (" + std::to_string(attached) +
                      " would be attached); use the sharded layout or a larger "
                      "RESIDENCY_SET_MAX_PCT, or turn attach_to_queues off");
  }
};

MetalBackend::MetalBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetalBackend::~MetalBackend() {
  impl_->pressure.stop();
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  while (!m.sets.empty()) m.destroy(m.sets.begin());
  m.queues.clear();
}

Capabilities MetalBackend::capabilities() const {
  Capabilities c;
  c.name = "metal";
  c.needs_refresh = impl_->refresh;
  c.refresh_period = impl_->refresh ? kRefreshPeriod : Nanos(0);
  c.max_sets = impl_->options.attach_to_queues ? kMetalMaxSetsPerQueue : 0;
  return c;
}

MemoryInfo MetalBackend::memory_info() {
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  MemoryInfo info;
  info.physical = NS::ProcessInfo::processInfo()->physicalMemory();
  info.recommended_working_set = m.device->recommendedMaxWorkingSetSize();
  return info;
}

Status MetalBackend::create_set(SetId set, std::uint64_t capacity_bytes) {
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  if (m.sets.count(set) != 0) {
    return Status(ErrorCode::invalid_argument, "metal: residency set " + std::to_string(set) + " already exists");
  }
  MTL::ResidencySetDescriptor* desc = MTL::ResidencySetDescriptor::alloc()->init();
  desc->setLabel(NS::String::string(m.options.label.c_str(), NS::UTF8StringEncoding));
  // initialCapacity counts allocations, not bytes: one per maxBufferLength of the hint.
  desc->setInitialCapacity(static_cast<NS::UInteger>(std::max<std::uint64_t>(1, capacity_bytes / m.max_view + 1)));
  NS::Error* error = nullptr;
  MTL::ResidencySet* rs = m.device->newResidencySet(desc, &error);
  desc->release();
  if (rs == nullptr) {
    return Status(ErrorCode::backend_error, "metal: newResidencySetWithDescriptor failed: " + describe(error));
  }
  Impl::Set s;
  s.set = NS::TransferPtr(rs);
  if (m.options.attach_to_queues) {
    // Every set is on every queue, so the number of sets is the number on each queue.
    if (!m.queues.empty() && m.sets.size() >= kMetalMaxSetsPerQueue) {
      return Impl::queue_limit_error(m.sets.size() + 1);  // s.set releases the new set
    }
    for (auto& q : m.queues) q->addResidencySet(rs);
  }
  m.sets.emplace(set, std::move(s));
  return Status::ok();
}

Status MetalBackend::destroy_set(SetId set) {
  metal::AutoreleasePool pool;
  MutexLock lock(impl_->mu);
  auto it = impl_->sets.find(set);
  if (it != impl_->sets.end()) impl_->destroy(it);
  return Status::ok();  // Metal's calls here report no errors
}

void MetalBackend::add_region(SetId set, const RegionDesc& region) {
  MutexLock lock(impl_->mu);
  auto it = impl_->sets.find(set);
  if (it == impl_->sets.end()) return;  // commit() of an unknown set reports it
  it->second.staged_remove.erase(region.id);
  it->second.staged_add[region.id] = region;
}

void MetalBackend::remove_region(SetId set, RegionId region) {
  MutexLock lock(impl_->mu);
  auto it = impl_->sets.find(set);
  if (it == impl_->sets.end()) return;
  it->second.staged_add.erase(region);
  it->second.staged_remove.insert(region);
}

SetOutcome MetalBackend::commit(SetId set) {
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  SetOutcome out;
  auto it = m.sets.find(set);
  if (it == m.sets.end()) {
    out.status = Status(ErrorCode::not_found, "metal: commit: no residency set " + std::to_string(set));
    return out;
  }
  Impl::Set& s = it->second;
  MTL::ResidencySet* rs = s.set.get();
  for (RegionId id : s.staged_remove) {
    auto member = s.members.find(id);
    if (member == s.members.end()) continue;
    for (auto& a : member->second.allocations) rs->removeAllocation(a.get());
    s.members.erase(member);
  }
  s.staged_remove.clear();
  for (auto& [id, desc] : s.staged_add) {
    if (s.members.count(id) != 0) continue;
    Impl::Member member{desc, {}};
    const Status st = desc.backend_object != nullptr ? Impl::allocations_of(desc, member.allocations)
                                                     : m.wrap(desc, member.allocations);
    if (!st) {
      out.failed.push_back(id);
      if (out.status.is_ok()) out.status = st;
      continue;
    }
    for (auto& a : member.allocations) rs->addAllocation(a.get());
    s.members.emplace(id, std::move(member));
  }
  s.staged_add.clear();
  rs->commit();
  // A requested set's new allocations are made resident by asking again.
  if (s.requested) rs->requestResidency();
  return out;
}

SetOutcome MetalBackend::request_residency(SetId set) {
  metal::AutoreleasePool pool;
  MutexLock lock(impl_->mu);
  SetOutcome out;
  auto it = impl_->sets.find(set);
  if (it == impl_->sets.end()) {
    out.status = Status(ErrorCode::not_found, "metal: request_residency: no residency set " + std::to_string(set));
    return out;
  }
  it->second.set->requestResidency();
  it->second.requested = true;
  return out;
}

Status MetalBackend::end_residency(SetId set) {
  metal::AutoreleasePool pool;
  MutexLock lock(impl_->mu);
  auto it = impl_->sets.find(set);
  if (it == impl_->sets.end())
    return Status(ErrorCode::not_found, "metal: end_residency of unknown set " + std::to_string(set));
  if (!it->second.requested) return Status::ok();
  it->second.set->endResidency();  // reports no error
  it->second.requested = false;
  return Status::ok();
}

// The blit at initialisation already ran GPU work in this process, which is all Metal needs
// to give ended sets back; repeat it only if that one failed.
void MetalBackend::after_release() {
  metal::AutoreleasePool pool;
  MutexLock lock(impl_->mu);
  if (impl_->gpu_work_done || impl_->options.test_no_gpu_work) return;
  (void)impl_->blit();
}

Result<PressureWatchId> MetalBackend::watch_pressure(std::function<void()> on_pressure) {
  Impl& m = *impl_;
  MutexLock lock(m.watch_mu);
  if (!m.pressure.running()) {
    Status st = m.pressure.start(m.options.pressure_repeat, [&m](metal::PressureLevel) {
      MutexLock g(m.watchers_mu);
      for (auto& [id, cb] : m.watchers) cb();
    });
    if (!st) return Status(st.code(), "memory pressure cannot be watched: " + st.message());
  }
  MutexLock g(m.watchers_mu);
  const PressureWatchId id = m.next_watch_id++;
  m.watchers.emplace(id, std::move(on_pressure));
  return id;
}

void MetalBackend::stop_pressure_watch(PressureWatchId id) {
  Impl& m = *impl_;
  MutexLock lock(m.watch_mu);
  bool last = false;
  {
    MutexLock g(m.watchers_mu);  // waits for a callback in flight
    if (m.watchers.erase(id) == 0) return;
    last = m.watchers.empty();
  }
  if (last) m.pressure.stop();
}

Status MetalBackend::add_command_queue(void* queue) {
  if (queue == nullptr) return Status(ErrorCode::invalid_argument, "metal: add_command_queue: queue is null");
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  auto* q = static_cast<MTL::CommandQueue*>(queue);
  MutexLock lock(m.mu);
  for (auto& known : m.queues) {
    if (known.get() == q) return Status::ok();
  }
  if (m.options.attach_to_queues) {
    if (m.sets.size() > kMetalMaxSetsPerQueue) return Impl::queue_limit_error(m.sets.size());
    for (auto& [id, s] : m.sets) q->addResidencySet(s.set.get());
  }
  m.queues.push_back(NS::RetainPtr(q));
  return Status::ok();
}

Status MetalBackend::remove_command_queue(void* queue) {
  metal::AutoreleasePool pool;
  Impl& m = *impl_;
  MutexLock lock(m.mu);
  auto it = std::find_if(m.queues.begin(), m.queues.end(), [queue](const auto& q) { return q.get() == queue; });
  if (it == m.queues.end()) {
    return Status(ErrorCode::not_found, "metal: remove_command_queue: that queue was not added");
  }
  if (m.options.attach_to_queues) {
    for (auto& [id, s] : m.sets) (*it)->removeResidencySet(s.set.get());
  }
  m.queues.erase(it);
  return Status::ok();
}

void* MetalBackend::device() const { return impl_->device.get(); }

MetalSupport metal_residency_support(void* device) {
  metal::AutoreleasePool pool;
  if (device != nullptr) return support_of(static_cast<MTL::Device*>(device));
  NS::SharedPtr<MTL::Device> d = NS::TransferPtr(MTL::CreateSystemDefaultDevice());
  return support_of(d.get());
}

Result<std::shared_ptr<MetalBackend>> make_metal_backend(MetalOptions options) {
  metal::AutoreleasePool pool;
  auto impl = std::make_unique<MetalBackend::Impl>();
  impl->device = options.device != nullptr ? NS::RetainPtr(static_cast<MTL::Device*>(options.device))
                                           : NS::TransferPtr(MTL::CreateSystemDefaultDevice());
  const MetalSupport support = support_of(impl->device.get());
  if (!support.available) {
    return Status(ErrorCode::unsupported, "use residency sets = false (" + support.reason + ")");
  }
  if (options.pressure_repeat.count() <= 0) {
    return Status(ErrorCode::invalid_argument, "metal: MetalOptions::pressure_repeat must be above 0");
  }
  impl->refresh = options.needs_refresh.value_or(os_at_least(kDecayingRequestsFromMacOS) &&
                                                 platform().residency_sets_from == 15);
  impl->page = static_cast<std::uint64_t>(getpagesize());
  impl->max_view = impl->device->maxBufferLength() / impl->page * impl->page;
  if (options.max_view_length != 0) {
    impl->max_view = std::min<std::uint64_t>(impl->max_view, options.max_view_length / impl->page * impl->page);
  }
  if (impl->page == 0 || impl->max_view == 0) {
    return Status(ErrorCode::invalid_argument,
                  "metal: the longest view (maxBufferLength " + std::to_string(impl->device->maxBufferLength()) +
                      ", MetalOptions::max_view_length " + std::to_string(options.max_view_length) +
                      ") is shorter than one page");
  }
  impl->options = std::move(options);
  // Run GPU work once now, so that residency ended later is given back (issue 25937).
  if (impl->options.test_no_gpu_work) {
    // (test only: show the bug)
  } else if (std::string why = impl->blit(); !why.empty()) {
    return Status(ErrorCode::backend_error,
                  "metal: the 1-byte blit at initialisation failed (" + why +
                      "); without GPU work in the process Metal would keep released memory wired");
  }
  return std::shared_ptr<MetalBackend>(new MetalBackend(std::move(impl)));
}

Result<std::shared_ptr<Backend>> make_metal_backend() {
  auto m = make_metal_backend(MetalOptions{});
  if (!m) return m.status();
  return std::shared_ptr<Backend>(std::move(m.value()));
}

struct MetalHostViews::Impl {
  std::vector<View> views;
  std::vector<NS::SharedPtr<MTL::Buffer>> buffers;
  NS::SharedPtr<NS::Array> array;
};

MetalHostViews::MetalHostViews(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetalHostViews::MetalHostViews(MetalHostViews&&) noexcept = default;
MetalHostViews& MetalHostViews::operator=(MetalHostViews&&) noexcept = default;
MetalHostViews::~MetalHostViews() {
  if (!impl_) return;
  metal::AutoreleasePool pool;
  impl_.reset();
}

const std::vector<View>& MetalHostViews::views() const { return impl_->views; }
void* MetalHostViews::buffer(std::size_t i) const {
  return i < impl_->buffers.size() ? impl_->buffers[i].get() : nullptr;
}
void* MetalHostViews::array() const { return impl_->array.get(); }

Result<MetalHostViews> MetalHostViews::make(void* device, void* base, std::uint64_t size,
                                            std::span<const Extent> tensors, std::uint64_t max_length) {
  if (device == nullptr) return Status(ErrorCode::invalid_argument, "metal: MetalHostViews::make: device is null");
  metal::AutoreleasePool pool;
  auto* dev = static_cast<MTL::Device*>(device);
  const auto page = static_cast<std::uint64_t>(getpagesize());
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  if (addr % page != 0) {
    return Status(ErrorCode::invalid_argument, "metal: host views need page-aligned memory (" + std::to_string(page) +
                                                   " bytes); mmap the file or use posix_memalign");
  }
  std::uint64_t max_view = dev->maxBufferLength() / page * page;
  if (max_length != 0) max_view = std::min<std::uint64_t>(max_view, max_length / page * page);
  const std::uint64_t rounded = (size + page - 1) / page * page;
  auto planned = plan_views(rounded, max_view, page, tensors, kMetalMaxViews);
  if (!planned) return Status(planned.status().code(), "metal: host views: " + planned.message());
  auto impl = std::make_unique<Impl>();
  impl->views = std::move(planned.value());
  std::vector<const NS::Object*> objects;
  for (const View& v : impl->views) {
    MTL::Buffer* b = no_copy_buffer(dev, addr + v.offset, v.length);
    if (b == nullptr) {
      return Status(ErrorCode::backend_error, "metal: newBufferWithBytesNoCopy failed for " + format_size(v.length) +
                                                  " at offset " + std::to_string(v.offset));
    }
    impl->buffers.push_back(NS::TransferPtr(b));
    objects.push_back(b);
  }
  impl->array = NS::RetainPtr(NS::Array::array(objects.data(), static_cast<NS::UInteger>(objects.size())));
  return MetalHostViews(std::move(impl));
}

MetalDeviceInfo read_metal_device_info(void* device) {
  metal::AutoreleasePool pool;
  NS::SharedPtr<MTL::Device> d = device != nullptr ? NS::RetainPtr(static_cast<MTL::Device*>(device))
                                                   : NS::TransferPtr(MTL::CreateSystemDefaultDevice());
  MetalDeviceInfo info;
  info.residency_sets = support_of(d.get());
  if (!d) return info;
  info.found = true;
  if (d->name() != nullptr) info.name = d->name()->utf8String();
  info.recommended_working_set = d->recommendedMaxWorkingSetSize();
  info.current_allocated = d->currentAllocatedSize();
  info.max_buffer_length = d->maxBufferLength();
  info.unified_memory = d->hasUnifiedMemory();
  return info;
}

}  // namespace residency
