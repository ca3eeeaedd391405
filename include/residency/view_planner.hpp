// SPDX-License-Identifier: MIT
// residency: splitting a large mapping into overlapping views.
//
// A backend may limit how long one buffer can be (Metal's maxBufferLength): a model file
// mapped in one piece larger than that must be wrapped in several buffers ("views"). An engine
// binds each tensor to one buffer, so every tensor must lie entirely inside one view. Views of
// the maximum length, each starting `max_len - overlap` after the previous one (rounded down to
// a page, as a no-copy buffer must start on a page) with
//     overlap = round_up(largest tensor, page) + page
// guarantee that: a tensor starting in the first `step` bytes of a view ends at most
// `largest tensor` bytes later, inside the overlap. llama.cpp does the same for mmap'd weights
// but never checks its 64-view limit; here a plan that would need more views than the backend
// accepts, or a tensor longer than one view, is an error instead of silence.
//
// A pure function: no backend, no system call, no allocation beyond the result.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "residency/status.hpp"

namespace residency {

// Bytes [offset, offset + size) of the mapping.
struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  bool operator==(const Extent&) const = default;
};

// One view: bytes [offset, offset + length) of the mapping. offset is a multiple of the page.
struct View {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool operator==(const View&) const = default;
};

// Plans the views of a mapping of `size` bytes for a backend whose buffers hold at most
// `max_len` bytes, with pages of `page` bytes (a power of two), so that every tensor in
// `tensors` lies entirely inside at least one view. A mapping that fits in one buffer gets one
// view. Views are in increasing offset order, cover [0, size), none is longer than max_len.
// Errors: invalid_argument for size 0, a page that is not a power of two, max_len < page, a
// tensor outside the mapping; limit_exceeded for a tensor longer than the room a view leaves
// (max_len minus two pages), or more than `max_views` views (the message says how many).
Result<std::vector<View>> plan_views(std::uint64_t size, std::uint64_t max_len, std::uint64_t page,
                                     std::span<const Extent> tensors, std::uint32_t max_views);

// The index of the first view that holds `tensor` entirely (where an engine binds it), or
// nullopt when none does.
std::optional<std::size_t> find_view(std::span<const View> views, Extent tensor);

}  // namespace residency
