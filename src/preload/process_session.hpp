// SPDX-License-Identifier: MIT
// The one pointer the hooks keep: the process's EngineSession, made on the first call that
// matters (a GGUF mapping, a ggml buffer, a device allocation), never at load time.
//
// Making it reads RESIDENCY_* (Config::from_env), checks that libllama's llama_decode is
// reachable behind the preload and that its llama.cpp is the one the preload was built against
// (engine_abi.hpp), installs a fork handler and gives the session its real backends
// (posix for the host, cuda per GPU), clock, ggml reader and llama_synchronize. Anything that
// fails is one warning, and from then on every hook only forwards. The session is never destroyed:
// engine threads may still be inside a hook while the process exits. A fork child passes through.
#pragma once

#include "engine_session.hpp"

namespace residency::preload {

// The session, made on first need; null: pass through (bad configuration, no libllama loaded,
// another llama.cpp than the build's, a second copy of the preload, a fork child, or out of memory). `near`: an address in the
// engine's libraries (a hook's caller), where llama.cpp's and ggml's functions are looked for
// when the host loaded them with dlopen.
EngineSession* process_session(const void* near) noexcept;
// The session if it was made already (never makes it); null: pass through or not yet.
EngineSession* started_session() noexcept;
// True in a fork child (every hook passes through).
bool forked_child() noexcept;
// One "residency[PID]: warn: preload: ..." line at the configured level (before the session is
// made: always).
void warn(const std::string& message) noexcept;

}  // namespace residency::preload
