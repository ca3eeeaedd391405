// SPDX-License-Identifier: MIT
// What `residency doctor` reads in a program or library file without running it: whether it is an
// ELF file the dynamic loader would preload into, what it links, what it defines, and the version
// strings ggml compiles into its library.
//
// Why not ldd: ldd runs the program's own interpreter (PT_INTERP), which for a hostile file is the
// file's choice of code; doctor runs a loader only after checking it is a root-owned system file
// (doctor.cpp), and reads everything else here. Reads are bounded (headers, the dynamic section,
// symbol tables up to kMaxTable bytes) and made with pread on a file opened O_NONBLOCK: a FIFO or
// a device named as a program is refused, never waited on. Host byte order only (every Linux
// target residency builds for is little-endian); a file of the other order is reported as such.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace residency::tool {

struct ElfInfo {
  std::string error;                // not empty: not read, or not an ELF file ("a script (#!/usr/bin/env node)")
  bool is64 = false;                // ELFCLASS64
  std::uint16_t type = 0;           // ET_EXEC, ET_DYN (a PIE program or a shared library)
  std::uint16_t machine = 0;        // EM_X86_64, EM_AARCH64, ...
  std::string interp;               // PT_INTERP: the dynamic loader a program asks for; empty in a library
  bool dynamic = false;             // has PT_DYNAMIC: links shared libraries (a static program has none)
  std::vector<std::string> needed;  // DT_NEEDED, in order
  std::string soname;               // DT_SONAME
  bool set_id = false;              // set-user-ID or set-group-ID bit: the loader ignores LD_PRELOAD paths

  // "ELF 64-bit x86-64": the class and machine, as the loader's refusals name them.
  std::string kind() const;
};

// The file's ELF header, program headers and dynamic section.
ElfInfo read_elf(const std::string& path);

// Whether the file defines `symbol` (a function or an object) in its dynamic or full symbol table:
// a program that defines llama_decode itself has llama.cpp linked statically. nullopt: could not tell.
std::optional<bool> elf_defines(const std::string& path, const std::string& symbol);

// The string that `function`, of the form `const char* f(void) { return "..."; }`, returns, read
// from its machine code (x86-64: lea rax,[rip+X]; ret; AArch64: adrp x0; add x0; ret): ggml's
// ggml_version() and ggml_commit(). nullopt: another form, another machine, or not printable.
std::optional<std::string> elf_returned_string(const std::string& path, const std::string& function);

}  // namespace residency::tool
