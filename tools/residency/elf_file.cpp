// SPDX-License-Identifier: MIT
#include "elf_file.hpp"

#if defined(__linux__)
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace residency::tool {
namespace {

// A symbol table (and its strings) larger than this is not read: a statically linked program's
// .symtab can be tens of MiB, and doctor reads two tables of each of a few files.
constexpr std::uint64_t kMaxTable = std::uint64_t{64} << 20;
// The most program headers, dynamic entries' bytes, and a string's bytes that are read.
constexpr std::uint16_t kMaxHeaders = 4096;
constexpr std::uint64_t kMaxDynamic = 64 * 1024;
constexpr std::size_t kMaxName = 4096;

// The file, opened so that nothing can make the open or a read wait (O_NONBLOCK: a FIFO named
// as a program), and only when it is a regular file.
class File {
 public:
  explicit File(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) {
      error_ = std::strerror(errno);
      return;
    }
    if (::fstat(fd_, &st_) != 0) {
      error_ = std::strerror(errno);
    } else if (!S_ISREG(st_.st_mode)) {
      error_ = S_ISDIR(st_.st_mode) ? "a directory" : "not a regular file";
    }
  }
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& error() const { return error_; }
  const struct stat& st() const { return st_; }
  // Exactly n bytes at off, or false.
  bool read(std::uint64_t off, void* buf, std::size_t n) const {
    if (off > static_cast<std::uint64_t>(st_.st_size) || n > static_cast<std::uint64_t>(st_.st_size) - off)
      return false;
    auto* p = static_cast<char*>(buf);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(off));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      p += r;
      off += static_cast<std::uint64_t>(r);
      n -= static_cast<std::size_t>(r);
    }
    return true;
  }
  // The NUL-terminated string at off, at most `max` bytes; nullopt without its NUL.
  std::optional<std::string> string_at(std::uint64_t off, std::size_t max = kMaxName) const {
    std::string s;
    char chunk[256];
    while (s.size() < max) {
      const std::uint64_t left = off < static_cast<std::uint64_t>(st_.st_size) ? st_.st_size - off : 0;
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(sizeof chunk, left));
      if (n == 0 || !read(off, chunk, n)) return std::nullopt;
      const void* nul = std::memchr(chunk, '\0', n);
      if (nul != nullptr) return s + std::string(chunk, static_cast<const char*>(nul) - chunk);
      s.append(chunk, n);
      off += n;
    }
    return std::nullopt;
  }

 private:
  int fd_ = -1;
  struct stat st_ {};
  std::string error_;
};

template <int Bits>
struct Elf;
template <>
struct Elf<64> {
  using Ehdr = Elf64_Ehdr;
  using Phdr = Elf64_Phdr;
  using Shdr = Elf64_Shdr;
  using Dyn = Elf64_Dyn;
  using Sym = Elf64_Sym;
  static unsigned type_of(unsigned char info) { return ELF64_ST_TYPE(info); }
};
template <>
struct Elf<32> {
  using Ehdr = Elf32_Ehdr;
  using Phdr = Elf32_Phdr;
  using Shdr = Elf32_Shdr;
  using Dyn = Elf32_Dyn;
  using Sym = Elf32_Sym;
  static unsigned type_of(unsigned char info) { return ELF32_ST_TYPE(info); }
};

// The program headers' loadable segments: where a virtual address lies in the file.
struct Segment {
  std::uint64_t vaddr, offset, filesz;
};
std::optional<std::uint64_t> file_offset(const std::vector<Segment>& loads, std::uint64_t vaddr) {
  for (const Segment& s : loads)
    if (vaddr >= s.vaddr && vaddr - s.vaddr < s.filesz) return s.offset + (vaddr - s.vaddr);
  return std::nullopt;
}

// The header's checks common to every read: an ELF file of the host's byte order. 0: not ELF.
int elf_class(const File& f, std::string& error) {
  unsigned char ident[EI_NIDENT] = {};
  if (!f.read(0, ident, 2)) {
    error = "not an ELF file";
    return 0;
  }
  if (ident[0] == '#' && ident[1] == '!') {
    char line[200] = {};  // the first line, at most 200 bytes of it
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(sizeof line, f.st().st_size));
    std::string first;
    if (f.read(0, line, n)) first.assign(line, n);
    first = first.substr(0, first.find_first_of("\n\r"));
    error = "a script (" + first + ")";
    return 0;
  }
  if (!f.read(0, ident, EI_NIDENT) || std::memcmp(ident, ELFMAG, SELFMAG) != 0) {
    error = "not an ELF file";
    return 0;
  }
  constexpr unsigned char kHostData = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? ELFDATA2LSB : ELFDATA2MSB;
  if (ident[EI_DATA] != kHostData) {
    error = "an ELF file of the other byte order";
    return 0;
  }
  if (ident[EI_CLASS] == ELFCLASS64) return 64;
  if (ident[EI_CLASS] == ELFCLASS32) return 32;
  error = "an ELF file of unknown class";
  return 0;
}

template <int Bits>
bool read_headers(const File& f, typename Elf<Bits>::Ehdr& eh, std::vector<typename Elf<Bits>::Phdr>& ph) {
  using E = Elf<Bits>;
  if (!f.read(0, &eh, sizeof eh)) return false;
  if (eh.e_phnum > kMaxHeaders || (eh.e_phnum > 0 && eh.e_phentsize != sizeof(typename E::Phdr))) return false;
  ph.resize(eh.e_phnum);
  return eh.e_phnum == 0 || f.read(eh.e_phoff, ph.data(), ph.size() * sizeof(typename E::Phdr));
}

template <int Bits>
std::vector<Segment> loads_of(const std::vector<typename Elf<Bits>::Phdr>& ph) {
  std::vector<Segment> loads;
  for (const auto& p : ph)
    if (p.p_type == PT_LOAD) loads.push_back({p.p_vaddr, p.p_offset, p.p_filesz});
  return loads;
}

template <int Bits>
void read_dynamic(const File& f, ElfInfo& info) {
  using E = Elf<Bits>;
  typename E::Ehdr eh{};
  std::vector<typename E::Phdr> ph;
  if (!read_headers<Bits>(f, eh, ph)) {
    info.error = "an ELF file whose headers cannot be read";
    return;
  }
  info.type = eh.e_type;
  info.machine = eh.e_machine;
  const std::vector<Segment> loads = loads_of<Bits>(ph);
  std::vector<typename E::Dyn> dyn;
  for (const auto& p : ph) {
    if (p.p_type == PT_INTERP) {
      info.interp = f.string_at(p.p_offset, std::min<std::uint64_t>(p.p_filesz, kMaxName)).value_or("");
    } else if (p.p_type == PT_DYNAMIC) {
      info.dynamic = true;
      dyn.resize(std::min<std::uint64_t>(p.p_filesz, kMaxDynamic) / sizeof(typename E::Dyn));
      if (!f.read(p.p_offset, dyn.data(), dyn.size() * sizeof(typename E::Dyn))) dyn.clear();
    }
  }
  std::uint64_t strtab = 0;
  std::vector<std::uint64_t> needed;
  std::optional<std::uint64_t> soname;
  for (const auto& d : dyn) {
    if (d.d_tag == DT_NULL) break;
    if (d.d_tag == DT_STRTAB) strtab = d.d_un.d_ptr;
    else if (d.d_tag == DT_NEEDED) needed.push_back(d.d_un.d_val);
    else if (d.d_tag == DT_SONAME) soname = d.d_un.d_val;
  }
  const auto at = file_offset(loads, strtab);
  if (!at) return;
  for (std::uint64_t n : needed)
    if (auto s = f.string_at(*at + n)) info.needed.push_back(*s);
  if (soname) info.soname = f.string_at(*at + *soname).value_or("");
}

// The value (a virtual address) of the defined function or object `name`, from the dynamic
// symbol table, else the full one. `known`: false when a table could not be read.
template <int Bits>
std::optional<std::uint64_t> symbol_value(const File& f, const std::string& name, bool functions_only, bool& known) {
  using E = Elf<Bits>;
  known = false;
  typename E::Ehdr eh{};
  if (!f.read(0, &eh, sizeof eh) || eh.e_shnum == 0 || eh.e_shnum > kMaxHeaders ||
      eh.e_shentsize != sizeof(typename E::Shdr))
    return std::nullopt;
  std::vector<typename E::Shdr> sh(eh.e_shnum);
  if (!f.read(eh.e_shoff, sh.data(), sh.size() * sizeof(typename E::Shdr))) return std::nullopt;
  known = true;
  for (const unsigned kind : {SHT_DYNSYM, SHT_SYMTAB}) {
    for (const auto& s : sh) {
      if (s.sh_type != kind || s.sh_link >= sh.size() || s.sh_entsize != sizeof(typename E::Sym)) continue;
      const auto& strs = sh[s.sh_link];
      if (s.sh_size > kMaxTable || strs.sh_size > kMaxTable) {
        known = false;  // too large to read: not found here does not mean not defined
        continue;
      }
      std::vector<typename E::Sym> syms(s.sh_size / sizeof(typename E::Sym));
      std::string names(strs.sh_size, '\0');
      if (!f.read(s.sh_offset, syms.data(), syms.size() * sizeof(typename E::Sym)) ||
          !f.read(strs.sh_offset, names.data(), names.size())) {
        known = false;
        continue;
      }
      for (const auto& sym : syms) {
        const unsigned type = E::type_of(sym.st_info);
        const bool kind_ok = type == STT_FUNC || type == STT_GNU_IFUNC || (!functions_only && type == STT_OBJECT);
        if (!kind_ok || sym.st_shndx == SHN_UNDEF || sym.st_name >= names.size()) continue;
        const char* n = names.data() + sym.st_name;  // NUL-terminated inside the table: compared so
        if (name.size() < names.size() - sym.st_name && std::memcmp(n, name.data(), name.size()) == 0 &&
            n[name.size()] == '\0')
          return static_cast<std::uint64_t>(sym.st_value);
      }
    }
  }
  return std::nullopt;
}

std::uint32_t le32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

// Where the code at `pc` (its first bytes in `code`) puts the address it returns, for the two
// forms compilers emit for `return "literal";` in position-independent code.
std::optional<std::uint64_t> returned_address(std::uint16_t machine, std::uint64_t pc, const unsigned char* code) {
  if (machine == EM_X86_64) {
    std::size_t i = 0;
    if (code[0] == 0xf3 && code[1] == 0x0f && code[2] == 0x1e && code[3] == 0xfa) i = 4;  // endbr64
    if (code[i] != 0x48 || code[i + 1] != 0x8d || code[i + 2] != 0x05 || code[i + 7] != 0xc3) return std::nullopt;
    const auto rel = static_cast<std::int32_t>(le32(code + i + 3));
    return pc + i + 7 + static_cast<std::uint64_t>(static_cast<std::int64_t>(rel));
  }
  if (machine == EM_AARCH64) {
    std::size_t i = 0;
    if (le32(code) == 0xd503245f) i = 4;  // bti c
    const std::uint32_t adrp = le32(code + i), add = le32(code + i + 4), ret = le32(code + i + 8);
    if ((adrp & 0x9f00001fU) != 0x90000000U || (add & 0xff8003ffU) != 0x91000000U || ret != 0xd65f03c0U)
      return std::nullopt;
    std::int64_t imm = static_cast<std::int64_t>(((adrp >> 5) & 0x7ffffU) << 2 | ((adrp >> 29) & 3U));
    if (imm & (std::int64_t{1} << 20)) imm -= std::int64_t{1} << 21;  // 21-bit signed
    const std::uint64_t page = ((pc + i) & ~std::uint64_t{0xfff}) + static_cast<std::uint64_t>(imm * 4096);
    const std::uint64_t lo = (add >> 10) & 0xfffU;
    return page + (((add >> 22) & 1U) != 0 ? lo << 12 : lo);
  }
  return std::nullopt;
}

template <int Bits>
std::optional<std::string> returned_string(const File& f, const std::string& function) {
  using E = Elf<Bits>;
  typename E::Ehdr eh{};
  std::vector<typename E::Phdr> ph;
  bool known = false;
  const auto value = symbol_value<Bits>(f, function, true, known);
  if (!value || !read_headers<Bits>(f, eh, ph)) return std::nullopt;
  const std::vector<Segment> loads = loads_of<Bits>(ph);
  const auto code_at = file_offset(loads, *value);
  unsigned char code[16] = {};
  if (!code_at || !f.read(*code_at, code, sizeof code)) return std::nullopt;
  const auto target = returned_address(eh.e_machine, *value, code);
  const auto text_at = target ? file_offset(loads, *target) : std::nullopt;
  if (!text_at) return std::nullopt;
  const auto s = f.string_at(*text_at, 128);
  if (!s || s->empty()) return std::nullopt;
  for (char c : *s)
    if (c < 0x20 || c > 0x7e) return std::nullopt;
  return s;
}

}  // namespace

std::string ElfInfo::kind() const {
  std::string m;
  switch (machine) {
    case EM_X86_64: m = "x86-64"; break;
    case EM_386: m = "i386"; break;
    case EM_AARCH64: m = "AArch64"; break;
    case EM_ARM: m = "ARM"; break;
    case EM_RISCV: m = "RISC-V"; break;
    case EM_PPC64: m = "PowerPC64"; break;
    case EM_S390: m = "S/390"; break;
    default: m = "machine " + std::to_string(machine);
  }
  return std::string("ELF ") + (is64 ? "64" : "32") + "-bit " + m;
}

ElfInfo read_elf(const std::string& path) {
  ElfInfo info;
  const File f(path);
  if (!f.error().empty()) {
    info.error = f.error();
    return info;
  }
  info.set_id = (f.st().st_mode & (S_ISUID | S_ISGID)) != 0;
  const int bits = elf_class(f, info.error);
  info.is64 = bits == 64;
  if (bits == 64) read_dynamic<64>(f, info);
  if (bits == 32) read_dynamic<32>(f, info);
  return info;
}

std::optional<bool> elf_defines(const std::string& path, const std::string& symbol) {
  const File f(path);
  std::string error;
  const int bits = f.error().empty() ? elf_class(f, error) : 0;
  if (bits == 0) return std::nullopt;
  bool known = false;
  const bool found = bits == 64 ? symbol_value<64>(f, symbol, false, known).has_value()
                                : symbol_value<32>(f, symbol, false, known).has_value();
  if (found) return true;
  return known ? std::optional<bool>(false) : std::nullopt;
}

std::optional<std::string> elf_returned_string(const std::string& path, const std::string& function) {
  const File f(path);
  std::string error;
  const int bits = f.error().empty() ? elf_class(f, error) : 0;
  if (bits == 64) return returned_string<64>(f, function);
  return std::nullopt;  // 32-bit: neither form above
}

}  // namespace residency::tool

#else

namespace residency::tool {
std::string ElfInfo::kind() const { return "not ELF"; }
ElfInfo read_elf(const std::string&) {
  ElfInfo info;
  info.error = "ELF files are read on Linux only";
  return info;
}
std::optional<bool> elf_defines(const std::string&, const std::string&) { return std::nullopt; }
std::optional<std::string> elf_returned_string(const std::string&, const std::string&) { return std::nullopt; }
}  // namespace residency::tool

#endif
