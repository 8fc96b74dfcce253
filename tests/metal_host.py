"""A host (x86-64 C++17) emulation of the few Metal Shading Language built-ins the kernel bodies use, so that every
kernel's Metal text — `veloxquant.gpu.COMPAT_METAL` + `PROLOGUE_METAL` + the body, exactly the strings handed to
`mx.fast.metal_kernel` — can be compiled by g++ on a machine without Metal (tests/test_metal_text.py).

What this checks: after the compatibility macros expand, the body is well-formed C++ (MSL is C++14-based) — every
name declared, every macro argument count right, types and overloads resolved, template constants used as
constants, vector member access (.x/.y/.z/.w), casts, `as_type`, the simd/threadgroup intrinsics with the argument
types the bodies give them. What it does not check is listed in `UNVERIFIED`."""
import re

HOST_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
using std::min; using std::max; using std::fmax; using std::fmin; using std::exp; using std::exp2; using std::fabs;
using std::round; using std::ceil; using std::sqrt; using std::fma;
// address spaces are erased (see UNVERIFIED)
#define device
#define threadgroup
#define constant
#define thread
typedef unsigned int uint; typedef unsigned short ushort; typedef unsigned char uchar;
typedef _Float16 half;
struct bfloat16_t {  // storage-only bfloat16, as Metal's bfloat: converts to and from float
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); bits = (uint16_t)(u >> 16); }
  operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
typedef bfloat16_t bfloat;
template <class T> struct vec2 {
  T x, y;
  vec2() = default;
  constexpr vec2(T a, T b) : x(a), y(b) {}
  explicit constexpr vec2(T a) : x(a), y(a) {}
  template <class U> explicit constexpr vec2(vec2<U> o) : x(T(o.x)), y(T(o.y)) {}
  vec2 operator+(vec2 o) const { return vec2(x + o.x, y + o.y); }
  vec2 operator-(vec2 o) const { return vec2(x - o.x, y - o.y); }
  vec2 operator*(vec2 o) const { return vec2(x * o.x, y * o.y); }
};
template <class T> struct vec4 { T x, y, z, w; };
typedef vec2<half> half2; typedef vec2<float> float2; typedef vec2<uint> uint2; typedef vec2<int> int2;
typedef vec4<float> float4; typedef vec4<uint> uint4; typedef vec4<half> half4;
struct uint3 { uint x, y, z; };
template <class T> vec2<T> fma(vec2<T> a, vec2<T> b, vec2<T> c) { return vec2<T>(a.x * b.x + c.x, a.y * b.y + c.y); }
inline half fmax(half a, half b) { return a > b ? a : b; }
template <class T, class U> T as_type(U u) { static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes"); T t; std::memcpy(&t, &u, sizeof(T)); return t; }
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
// Metal atomics (the fused decode's arrival counter): declarations only, for the syntax and type check
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_device, thread_scope_threadgroup };
struct atomic_uint { unsigned int v; };
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) {}
inline unsigned int atomic_fetch_add_explicit(atomic_uint* a, unsigned int x, memory_order) { unsigned int o = a->v; a->v += x; return o; }
inline void atomic_store_explicit(atomic_uint* a, unsigned int x, memory_order) { a->v = x; }
// one lane's view of the simd intrinsics: types and arity as in the MSL standard library, values not modelled
template <class T> T simd_sum(T x) { return x; }
template <class T> T simd_max(T x) { return x; }
template <class T> T simd_min(T x) { return x; }
template <class T> T simd_shuffle(T x, ushort) { return x; }
template <class T> T simd_shuffle_xor(T x, ushort) { return x; }
struct simd_vote { typedef uint64_t vote_t; vote_t v; explicit operator vote_t() const { return v; } };
inline simd_vote simd_ballot(bool p) { return simd_vote{p ? 1ull : 0ull}; }
inline uint popcount(uint x) { return (uint)__builtin_popcount(x); }
"""

METAL_TYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16_t", "uint32": "uint", "int32": "int", "uint8": "uchar"}
BUILTINS = "uint3 thread_position_in_threadgroup, uint3 threadgroup_position_in_grid, uint thread_index_in_simdgroup, uint simdgroup_index_in_threadgroup"

UNVERIFIED = """- address spaces: `device`, `threadgroup`, `constant` and `thread` are erased, so a pointer that crosses address spaces
  (which MSL refuses) compiles here;
- MSL-only language rules (no recursion, no `new`, restrictions on lambdas and on pointers to threadgroup memory in
  helper functions) and the exact MSL standard library overload set (an overload g++ resolves may be ambiguous in
  MSL, e.g. `min` of mixed int/uint, and vice versa);
- the `[[kernel]]` signature MLX generates (argument order, `[[buffer(i)]]`, `constant int* x_shape`), emulated here
  from the registry's signature types;
- `_Pragma("clang loop ...")` unrolling hints (ignored by g++);
- threadgroup memory size (MSL: 32 KB) and alignment, register pressure, and launch limits (1,024 threads per
  threadgroup);
- every runtime behaviour: simdgroup semantics (32 lanes, shuffles, ballots, `simd_sum`), barriers, races,
  out-of-bounds accesses, half/bfloat arithmetic precision, and the numbers the kernels compute — none of this has run
  on Apple hardware; the CUDA build of the same bodies is parity-tested on the lent H200 instead, and on Apple
  hardware the safety net (`veloxquant.gpu.GuardedKernel`) falls back to the reference path if a kernel does not
  compile or launch."""


def metal_host_source(kname: str, body: str, types: dict, template: dict) -> str:
    "One C++ translation unit: the host prelude, COMPAT_METAL, a kernel function as MLX would generate it, the body."
    import veloxquant.gpu as gpu
    ty = lambda t: METAL_TYPES[template[t]] if isinstance(template.get(t), str) else METAL_TYPES[t]  # noqa: E731
    sig = []
    for n, t in types["inputs"]:
        sig.append(f"const device {ty(t)}* {n}")
        for extra in ("shape", "strides"):
            if re.search(rf"\b{n}_{extra}\b", body): sig.append(f"const constant int* {n}_{extra}")
        if re.search(rf"\b{n}_ndim\b", body): sig.append(f"const constant int& {n}_ndim")
    sig += [f"device {ty(t)}* {n}" for n, t in types["outputs"]]
    consts = "".join(f"  using {k} = {METAL_TYPES[v]};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                     for k, v in template.items())
    return (HOST_PRELUDE + gpu.COMPAT_METAL + f"\nvoid {kname}(" + ", ".join(sig + [BUILTINS]) + ") {\n" + consts
            + gpu.PROLOGUE_METAL + body + "\n}\n")
