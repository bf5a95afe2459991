// Runs one launch of one of pipec's CUDA kernels on the host (see emu.hpp), for
// tests/integration/cuda_kernels.rs. The kernel source is the exact text of
// `pipec_runtime::backend::cuda::kernels::source(bf16)`. The test writes it to
// `pipec_kernels.cu` in a directory it passes with -I.
//
// Protocol (all integers little-endian, as on the hosts we test on):
//   request on stdin:
//     "PKRQ", u32 name length, name bytes,
//     u32 grid.x, grid.y, grid.z, u32 block.x, block.y, block.z,
//     u32 argument count, then per argument a kind byte and its value:
//       'f' f32 buffer, 'h' u16 buffer (bf16 bits), 'u' u32 buffer: u32 count, count elements;
//       'i' i32 scalar, 's' f32 scalar: 4 bytes.
//   reply on stdout, exit status 0:
//     "PKRS", u32 buffer count, then per buffer argument, in argument order: its kind byte,
//     u32 count, count elements (the buffer after the launch).
//   Errors go to stderr with a nonzero exit status:
//     2: malformed request, unknown kernel, or arguments that do not match the kernel's
//        C signature in count, order or type;
//     3: the kernel wrote into the canary zone past the end of a buffer.
// `driver --names` prints the kernels it can dispatch, one per line.
//
// Each buffer is followed by a canary zone as long as the longest buffer of the request plus 64
// elements: NaN for float and bf16, 0xdeadbeef for u32. An out-of-bounds read therefore sees
// poison rather than another buffer, and an out-of-bounds write is reported (exit 3).
#include "emu.hpp"

#include "pipec_kernels.cu"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <unistd.h>
#include <utility>

namespace drv {

[[noreturn]] void fail(int code, const std::string& msg) {
    std::fprintf(stderr, "cuda_emu driver: %s\n", msg.c_str());
    std::exit(code);
}

void read_exact(void* p, std::size_t n) {
    if (n && std::fread(p, 1, n, stdin) != n) fail(2, "truncated request");
}
std::uint32_t read_u32() {
    std::uint32_t v;
    read_exact(&v, 4);
    return v;
}
void write_exact(const void* p, std::size_t n) {
    if (n && std::fwrite(p, 1, n, stdout) != n) fail(2, "cannot write the reply");
}

const float F32_CANARY = __uint_as_float(0x7fc0deadu);
const unsigned short BF16_CANARY = 0x7fdeu;
const unsigned int U32_CANARY = 0xdeadbeefu;

struct Arg {
    char kind = 0;
    std::size_t count = 0;  // elements, without the canary zone
    std::vector<float> f;
    std::vector<unsigned short> h;
    std::vector<unsigned int> u;
    int i = 0;
    float s = 0.0f;

    bool is_buffer() const { return kind == 'f' || kind == 'h' || kind == 'u'; }
};

const char* kind_name(char k) {
    switch (k) {
        case 'f': return "a float buffer";
        case 'h': return "a bf16 (u16) buffer";
        case 'u': return "a u32 buffer";
        case 'i': return "an i32 scalar";
        case 's': return "an f32 scalar";
        default: return "an unknown kind";
    }
}

template <class>
inline constexpr bool unsupported = false;

// The request kind a kernel parameter of C type P must receive.
template <class P>
constexpr char kind_of() {
    if constexpr (std::is_same_v<P, int>) {
        return 'i';
    } else if constexpr (std::is_same_v<P, float>) {
        return 's';
    } else if constexpr (std::is_pointer_v<P>) {
        using E = std::remove_cv_t<std::remove_pointer_t<P>>;
        if constexpr (std::is_same_v<E, float>) return 'f';
        else if constexpr (std::is_same_v<E, unsigned short>) return 'h';
        else if constexpr (std::is_same_v<E, unsigned int>) return 'u';
        else static_assert(unsupported<P>, "a kernel parameter type the driver cannot pass");
    } else {
        static_assert(unsupported<P>, "a kernel parameter type the driver cannot pass");
    }
}

template <class P>
P value(Arg& a) {
    if constexpr (std::is_same_v<P, int>) {
        return a.i;
    } else if constexpr (std::is_same_v<P, float>) {
        return a.s;
    } else {
        using E = std::remove_cv_t<std::remove_pointer_t<P>>;
        if constexpr (std::is_same_v<E, float>) return a.f.data();
        else if constexpr (std::is_same_v<E, unsigned short>) return a.h.data();
        else return a.u.data();
    }
}

template <class... P, std::size_t... I>
void call_with(void (*kernel)(P...), std::vector<Arg>& args, dim3 grid, dim3 block,
               std::index_sequence<I...>) {
    struct Ctx {
        void (*kernel)(P...);
        std::tuple<P...> vals;
    } ctx{kernel, {value<P>(args[I])...}};
    emu::launch(grid, block, [](void* c) {
        auto* x = static_cast<Ctx*>(c);
        std::apply(x->kernel, x->vals);
    }, &ctx);
}

// Check the request's arguments against the kernel's C signature, then launch it.
template <class... P>
void call(const std::string& name, void (*kernel)(P...), std::vector<Arg>& args, dim3 grid,
          dim3 block) {
    if (args.size() != sizeof...(P))
        fail(2, name + " takes " + std::to_string(sizeof...(P)) + " arguments, the request gives " +
                    std::to_string(args.size()));
    const char want[] = {kind_of<P>()..., 0};
    for (std::size_t k = 0; k < args.size(); k++)
        if (args[k].kind != want[k])
            fail(2, "argument " + std::to_string(k) + " of " + name + ": the kernel takes " +
                        kind_name(want[k]) + ", the request gives " + kind_name(args[k].kind));
    call_with(kernel, args, grid, block, std::index_sequence_for<P...>{});
}

using Runner = void (*)(const std::string&, std::vector<Arg>&, dim3, dim3);
struct Entry {
    const char* name;
    Runner run;
};

#define PIPEC_KERNEL(k) \
    Entry { #k, [](const std::string& n, std::vector<Arg>& a, dim3 g, dim3 b) { call(n, k, a, g, b); } }

// Every kernel of kernels::NAMES. The test fails if a name there has no entry here.
const Entry TABLE[] = {
    PIPEC_KERNEL(bias_gelu_fwd), PIPEC_KERNEL(add_bias),   PIPEC_KERNEL(add_bias_residual),
    PIPEC_KERNEL(gelu_bwd),      PIPEC_KERNEL(add_into),   PIPEC_KERNEL(col_sums),
    PIPEC_KERNEL(embed_fwd),     PIPEC_KERNEL(embed_bwd),  PIPEC_KERNEL(softmax_xent_fwd),
    PIPEC_KERNEL(loss_mean),     PIPEC_KERNEL(xent_bwd),   PIPEC_KERNEL(accum),
    PIPEC_KERNEL(sgd),           PIPEC_KERNEL(to_f32),
};

template <class E>
void read_buffer(std::vector<E>& v, std::size_t count) {
    v.resize(count);
    read_exact(v.data(), count * sizeof(E));
}

template <class E>
bool canary_intact(const std::vector<E>& v, std::size_t count, E canary) {
    for (std::size_t k = count; k < v.size(); k++)
        if (std::memcmp(&v[k], &canary, sizeof(E)) != 0) return false;
    return true;
}

int serve() {
    char magic[4];
    read_exact(magic, 4);
    if (std::memcmp(magic, "PKRQ", 4) != 0) fail(2, "not a request (bad magic)");
    std::string name(read_u32(), '\0');
    read_exact(name.data(), name.size());
    dim3 grid, block;
    grid.x = read_u32();
    grid.y = read_u32();
    grid.z = read_u32();
    block.x = read_u32();
    block.y = read_u32();
    block.z = read_u32();
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z)
        fail(2, "empty grid or block");
    if (std::size_t(block.x) * block.y * block.z > 1024) fail(2, "more than 1024 threads per block");
    const std::uint32_t nargs = read_u32();
    if (nargs > 64) fail(2, "too many arguments");

    // Kinds and sizes first (the canary zone depends on the longest buffer), then the data.
    std::vector<Arg> args(nargs);
    std::size_t longest = 0;
    for (auto& a : args) {
        read_exact(&a.kind, 1);
        if (a.is_buffer()) {
            a.count = read_u32();
            longest = std::max(longest, a.count);
        }
        switch (a.kind) {
            case 'f': read_buffer(a.f, a.count); break;
            case 'h': read_buffer(a.h, a.count); break;
            case 'u': read_buffer(a.u, a.count); break;
            case 'i': read_exact(&a.i, 4); break;
            case 's': read_exact(&a.s, 4); break;
            default: fail(2, std::string("unknown argument kind byte ") + std::to_string(int(a.kind)));
        }
    }
    const std::size_t pad = longest + 64;
    for (auto& a : args) {
        if (a.kind == 'f') a.f.resize(a.count + pad, F32_CANARY);
        if (a.kind == 'h') a.h.resize(a.count + pad, BF16_CANARY);
        if (a.kind == 'u') a.u.resize(a.count + pad, U32_CANARY);
    }

    const Entry* entry = nullptr;
    for (const auto& e : TABLE)
        if (name == e.name) entry = &e;
    if (!entry) fail(2, "no kernel named `" + name + "` in the driver's table");
    entry->run(name, args, grid, block);

    for (std::size_t k = 0; k < args.size(); k++) {
        const Arg& a = args[k];
        bool ok = a.kind == 'f'   ? canary_intact(a.f, a.count, F32_CANARY)
                  : a.kind == 'h' ? canary_intact(a.h, a.count, BF16_CANARY)
                  : a.kind == 'u' ? canary_intact(a.u, a.count, U32_CANARY)
                                  : true;
        if (!ok)
            fail(3, name + " wrote past the end of argument " + std::to_string(k) + " (" +
                        std::to_string(a.count) + " elements)");
    }

    write_exact("PKRS", 4);
    std::uint32_t nbuf = 0;
    for (const auto& a : args) nbuf += a.is_buffer();
    write_exact(&nbuf, 4);
    for (const auto& a : args) {
        if (!a.is_buffer()) continue;
        const std::uint32_t n = a.count;
        write_exact(&a.kind, 1);
        write_exact(&n, 4);
        if (a.kind == 'f') write_exact(a.f.data(), n * 4);
        if (a.kind == 'h') write_exact(a.h.data(), n * 2);
        if (a.kind == 'u') write_exact(a.u.data(), n * 4);
    }
    return std::fflush(stdout) == 0 ? 0 : 2;
}

}  // namespace drv

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "--names") {
        for (const auto& e : drv::TABLE) std::printf("%s\n", e.name);
        return 0;
    }
    // A kernel that deadlocks at a barrier must fail the test, not hang it.
    alarm(60);
    return drv::serve();
}
