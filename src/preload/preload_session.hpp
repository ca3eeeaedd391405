// SPDX-License-Identifier: MIT
// The preload's one session per process: what each interposed call does (interpose.cpp only
// forwards to these).
//
// Nothing happens when the library is loaded. The first mapping of a GGUF file, or the first
// buffer ggml makes, starts the session: the configuration (Config::from_env), a check that libllama's llama_decode is reachable
// behind the preload, a fork handler, and one Manager over make_backend("auto"), whose start-up
// lines are the log. Anything that fails there is one warning line, and from then on every call
// passes straight through. The manager is never destroyed: engine threads may still be inside a
// hook while the process exits, and a fork child must not touch it (the child passes through).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include <string>

#include <ggml-backend.h>
#include <llama.h>

#include "next_calls.hpp"
#include "residency/residency.hpp"

namespace residency::preload {

enum class Entry { decode, encode };

// What both sessions (host mappings here, device memory in device_memory.hpp) start from, made
// once per process on first need: the configuration (Config::from_env), llama_synchronize behind
// the preload, and a clock that is never destroyed.
// Null when the preload must pass through: a bad variable, no libllama behind the preload (each
// is one warning), or a fork child.
// llama_synchronize(ctx), as Manager::end_call() calls it.
void synchronize_context(void* ctx) noexcept;

struct Startup {
  Config config;
  SynchronizeFn synchronize;
  Clock* clock;
};
const Startup* startup() noexcept;
bool forked_child() noexcept;
// One "residency[PID]: warn: preload: ..." line (unless RESIDENCY_LOG silences warnings).
void warn(const std::string& message) noexcept;
// One "residency[PID]: info: preload: ..." line (RESIDENCY_LOG=info or debug).
void info(const std::string& message) noexcept;
// One "residency[PID]: debug: preload: ..." line (RESIDENCY_LOG=debug).
void debug(const std::string& message) noexcept;

// mmap / mmap64: the real call, then a GGUF file mapping (regular file whose first 4 bytes are
// "GGUF", mapped readable and not writable) is remembered (not registered: what is registered is
// llama.cpp's buffers, ggml_buffers.hpp). A MAP_FIXED mapping over tracked memory is an unmap of
// what it replaces.
void* map_hook(void* addr, std::size_t len, int prot, int flags, int fd, off64_t off, bool is64) noexcept;
// munmap: tracked pieces it touches are unregistered before the real call; what is left of them
// is registered again after it.
int unmap_hook(void* addr, std::size_t len) noexcept;
// llama_decode / llama_encode: one engine call (Manager::begin_call() before the real call,
// end_call() after it, with llama_synchronize(ctx) for the manager to wait on under keep-alive 0).
std::int32_t decode_hook(Entry which, llama_context* ctx, llama_batch batch);

// After ggml made buffer `b` (ggml_backend_buft_alloc_buffer; from_ptr: over memory that is not
// ggml's, ggml_backend_cpu_buffer_from_ptr / ggml_backend_dev_buffer_from_host_ptr).
void buffer_created_hook(ggml_backend_buffer_t b, bool from_ptr) noexcept;
// After ggml_backend_tensor_alloc placed `t` at `addr` in `b` (lock-free unless `b` is from_ptr).
void tensor_alloc_hook(ggml_backend_buffer_t b, const struct ggml_tensor* t, const void* addr) noexcept;
// After ggml_backend_buffer_set_usage.
void buffer_usage_hook(ggml_backend_buffer_t b, enum ggml_backend_buffer_usage usage) noexcept;
// Before ggml_backend_buffer_free: the buffer's regions are unregistered while it exists.
void buffer_free_hook(ggml_backend_buffer_t b) noexcept;
// After llama_model_load_from_file / _from_splits returned a model: its buffers are registered,
// and the file pages no buffer reads are given back.
void model_loaded_hook(const llama_model* model) noexcept;
// After llama_init_from_model returned a context: its KV cache and compute buffers are registered.
void context_made_hook(const llama_context* ctx) noexcept;

}  // namespace residency::preload
