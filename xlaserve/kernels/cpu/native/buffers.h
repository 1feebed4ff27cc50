// FFI buffer types by name, for the handler bindings: a comma inside a template argument
// (ffi::Buffer<ffi::F32, 2>) would split XLA_FFI_DEFINE_HANDLER_SYMBOL's macro arguments.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

namespace ffi = xla::ffi;

using F32_2 = ffi::Buffer<ffi::F32, 2>;
using F32_3 = ffi::Buffer<ffi::F32, 3>;
using F32_4 = ffi::Buffer<ffi::F32, 4>;
using S32_0 = ffi::Buffer<ffi::S32, 0>;
using S32_1 = ffi::Buffer<ffi::S32, 1>;
using S32_2 = ffi::Buffer<ffi::S32, 2>;

}  // namespace xlaserve
