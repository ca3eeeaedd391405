// SPDX-License-Identifier: MIT
// Whether this preload serves the llama.cpp in the process: only the one it was built against
// (abi_check.hpp says why and how it is recognised). Decided once, when the first libllama is
// loaded; a refusal is one warning. A refused llama.cpp runs exactly as without the preload: no
// session starts, and every hooked llama.cpp or ggml function jumps straight to the library's own
// (interpose.cpp's trampolines), with its arguments untouched whatever their layout.
#pragma once

namespace residency::preload {

enum class EngineAbi {
  unknown,  // no libllama is loaded yet (or the verdict is being made on this thread)
  served,   // the llama.cpp the preload was built against
  refused,  // another one: pass through for the process's life
};

// The verdict on the process's libllama (the first one loaded). Lock-free once made, and for a
// hook while no libllama is loaded and libraries did not change since that was found. Making it looks the
// library's functions up (dlopen with RTLD_NOLOAD, dlsym) and calls its version and default-params
// functions (no side effects), under a lock of its own, which a hook never waits for: a hooked call
// made while another thread decides (`may_wait` false) is told unknown and passes through, so that
// a library constructor calling a hook inside the dynamic loader's lock cannot deadlock against the
// decider's dlopen. Starting the session waits (`may_wait` true).
EngineAbi engine_abi(bool may_wait) noexcept;

}  // namespace residency::preload
