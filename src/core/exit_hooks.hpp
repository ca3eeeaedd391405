// SPDX-License-Identifier: MIT
// Exit hooks: work done at exit() for objects nobody destroys.
//
// The preload leaks its managers on purpose (a host program's exit may run while its threads
// still decode), so a manager with a shared budget cannot leave the ledger from its destructor;
// it registers here and leaves at exit, once, from one std::atexit handler. The registry is never
// destroyed: exit() may run the handler after other statics are gone.
#pragma once

namespace residency::core {

// Runs `fn(key)` at exit unless remove_exit_hook(key) ran first. One hook per key.
void add_exit_hook(void* key, void (*fn)(void* key));
void remove_exit_hook(void* key);

}  // namespace residency::core
