// SPDX-License-Identifier: MIT
// residency cuda backend: a loaded CUDA module (kernels embedded in the executable).
//
// Kernels are compiled by nvcc at build time into a fatbin that is embedded as a byte array
// (embed_binary.cmake) and loaded here with cuModuleLoadData, so no libcudart is linked and
// nothing has to be found on disk at run time. The backend itself launches no kernel; its
// tests, benchmarks and the GPU decode pass do.
#pragma once

#include <cuda.h>

#include <string>
#include <utility>

#include "backends/cuda/driver.hpp"

namespace residency::cuda {

class Module {
 public:
  Module() = default;
  Module(Module&& o) noexcept { *this = std::move(o); }
  Module& operator=(Module&& o) noexcept {
    if (this != &o) {
      reset();
      d_ = std::exchange(o.d_, nullptr);
      ctx_ = std::exchange(o.ctx_, nullptr);
      mod_ = std::exchange(o.mod_, nullptr);
    }
    return *this;
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  ~Module() { reset(); }

  // Loads `image` (a fatbin, cubin or PTX) into `ctx`.
  static Result<Module> load(const Driver& d, CUcontext ctx, const void* image, const char* what) {
    ContextScope scope(d, ctx);
    Module m;
    const CUresult r = d.cuModuleLoadData(&m.mod_, image);
    if (r != CUDA_SUCCESS) {
      Status s = d.error(r, std::string("loading the ") + what + " kernels", "cuModuleLoadData");
      return Status(s.code(), s.message() +
                                  " (the build embeds code for RESIDENCY_CUDA_ARCHS; "
                                  "rebuild with this GPU's architecture added)");
    }
    m.d_ = &d;
    m.ctx_ = ctx;
    return m;
  }
  Result<CUfunction> function(const char* name) const {
    CUfunction f = nullptr;
    const CUresult r = d_->cuModuleGetFunction(&f, mod_, name);
    if (r != CUDA_SUCCESS) return d_->error(r, std::string("finding kernel ") + name, "cuModuleGetFunction");
    return f;
  }

 private:
  void reset() {
    if (mod_ != nullptr) {
      ContextScope scope(*d_, ctx_);
      (void)d_->cuModuleUnload(mod_);
    }
    mod_ = nullptr;
  }
  const Driver* d_ = nullptr;
  CUcontext ctx_ = nullptr;
  CUmodule mod_ = nullptr;
};

}  // namespace residency::cuda
