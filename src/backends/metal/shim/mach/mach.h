// Shim (compile checks on Linux only; see ../README.md): the mach types of
// MTL::Resource::setOwner.
#pragma once

typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
