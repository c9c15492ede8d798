"""Integer dot products on the CPU's 8-bit multiply-add instruction (VNNI `vpdpbusd`), as register tiles.

`vpdpbusd acc, a, b` adds to each int32 lane of acc the four products of the lane's four unsigned bytes of a
with its four signed bytes of b:

    acc[l] += a[4l] b[4l] + a[4l+1] b[4l+1] + a[4l+2] b[4l+2] + a[4l+3] b[4l+3]      (u8 x s8, wrapping int32)

Each product lies in [-32640, 32385] and the four are summed at full precision (the non-saturating form; the
pair-saturating `vpmaddubsw` of plain AVX2 is not used), so the instruction is the exact integer sum modulo
2^32. A tile (`tile_kernel(rows, vectors)`) holds `rows` x `vectors` accumulators: lane l of vector v of row r
is output channel 16v + l (a group of `lanes` channels) of pixel r; per step q it broadcasts the four bytes
x[r, 4q:4q+4] of each row and multiplies them against the packed weights w[g, q, l, 0:4] = w[16g + l, 4q:4q+4]
(zero past the last channel and the last input channel, `pack_weight`). After the K/4 steps

    acc[r, m] = sum_k x[r, k] * w[m, k]   modulo 2^32,

which is the true sum when |sum| < 2^31; callers prove that from max|x| * max_m sum_k |w[m, k]| < 2^31
(`ops.compiled.int_gemm`). A signed int8 x is read as the unsigned byte x + 128 (the sign bit flipped as each
broadcast is formed); the caller folds the 128 * sum_k w[m, k] it adds into its zero-point offset.

The kernel exists where the CPU (as numba compiles for it) has AVX512-VNNI (16 lanes of a 512-bit vector) or
AVX-VNNI (8 lanes); `LANES` is 0 elsewhere and callers keep their other path.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# a step's 4 input channels per 32-bit lane
QUAD = 4


def _target_features() -> set[str]:
    """The CPU features numba compiles for: the host's, unless NUMBA_CPU_NAME names another CPU (an
    explicit NUMBA_CPU_FEATURES then lists them; else none is assumed)."""
    name = numba.config.CPU_NAME
    if name and name != "host":
        listed = numba.config.CPU_FEATURES or ""
    else:
        listed = binding.get_host_cpu_features().flatten()
    return {f[1:] for f in listed.split(",") if f.startswith("+")}


def _lanes(features: set[str]) -> int:
    if {"avx512f", "avx512vnni"} <= features:
        return 16
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        return 8
    return 0


LANES = _lanes(_target_features())
_INTRINSIC = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}


def pack_weight(weight: np.ndarray, lanes: int = 0) -> np.ndarray:
    """The weight (M, K) of int8 values as int8 (G, Q, lanes, 4), G = ceil(M / lanes), Q = ceil(K / 4):
    packed[g, q, l, j] = weight[g * lanes + l, 4q + j], zero where that is past M or K."""
    lanes = lanes or LANES
    m, k = weight.shape
    groups, quads = -(-m // lanes), -(-k // QUAD)
    padded = np.zeros((groups * lanes, quads * QUAD), dtype=np.int8)
    padded[:m, :k] = weight
    return np.ascontiguousarray(padded.reshape(groups, lanes, quads, QUAD).transpose(0, 2, 1, 3))


def _is_flat(arr, dtype) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.ndim == 1 and arr.layout == "C"


def tile_kernel(rows: int, vectors: int):
    """The compiled tile `tile(x, x_at, x_stride, flip, w, w_at, w_stride, quads, acc, acc_at, acc_stride)`:

        acc[acc_at + r * acc_stride + v * LANES + l] = sum_{q < quads, j < 4} (x[x_at + r * x_stride + 4q + j]
                                                         ^ flip) * w[w_at + v * w_stride + (q * LANES + l) * 4 + j]

    for r < rows, v < vectors, l < LANES (x: flat uint8, w: flat int8 packed by `pack_weight`, acc: flat int32;
    flip 0x80808080 reads int8 bytes as x + 128, else 0; no bounds check: the caller keeps every index inside)."""
    lanes = LANES

    @intrinsic
    def tile(typingctx, x, x_at, x_stride, flip, w, w_at, w_stride, quads, acc, acc_at, acc_stride):
        if not (_is_flat(x, types.uint8) and _is_flat(w, types.int8) and _is_flat(acc, types.int32)):
            return None
        sig = types.none(x, types.intp, types.intp, types.uint32, w, types.intp, types.intp, types.intp, acc,
                         types.intp, types.intp)

        def codegen(context, builder, signature, args):
            x_arr, x_at, x_stride, flip, w_arr, w_at, w_stride, quads, acc_arr, acc_at, acc_stride = args
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            vec = ir.VectorType(i32, lanes)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                                _INTRINSIC[lanes])
            x_data = context.make_array(signature.args[0])(context, builder, x_arr).data
            w_data = context.make_array(signature.args[4])(context, builder, w_arr).data
            acc_data = context.make_array(signature.args[8])(context, builder, acc_arr).data
            x_rows = [builder.gep(x_data, [builder.add(x_at, builder.mul(x_stride, ir.Constant(intp, r)))])
                      for r in range(rows)]
            w_vecs = [builder.gep(w_data, [builder.add(w_at, builder.mul(w_stride, ir.Constant(intp, v)))])
                      for v in range(vectors)]
            zero = ir.Constant(vec, [0] * lanes)
            splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)

            entry = builder.block
            header = builder.append_basic_block("tile.header")
            body = builder.append_basic_block("tile.body")
            done = builder.append_basic_block("tile.done")
            builder.branch(header)

            builder.position_at_end(header)
            q = builder.phi(intp)
            q.add_incoming(ir.Constant(intp, 0), entry)
            accs = []
            for _ in range(rows * vectors):
                phi = builder.phi(vec)
                phi.add_incoming(zero, entry)
                accs.append(phi)
            builder.cbranch(builder.icmp_signed("<", q, quads), body, done)

            builder.position_at_end(body)
            byte_at = builder.mul(q, ir.Constant(intp, QUAD))
            weights = []
            for v in range(vectors):
                at = builder.mul(q, ir.Constant(intp, lanes * QUAD))
                load = builder.load(builder.bitcast(builder.gep(w_vecs[v], [at]), vec.as_pointer()))
                load.align = 1
                weights.append(load)
            updated = []
            for r in range(rows):
                word = builder.load(builder.bitcast(builder.gep(x_rows[r], [byte_at]), i32.as_pointer()))
                word.align = 1
                word = builder.xor(word, flip)
                broadcast = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, None), word,
                                                                          ir.Constant(i32, 0)),
                                                   ir.Constant(vec, None), splat)
                for v in range(vectors):
                    updated.append(builder.call(fn, [accs[r * vectors + v], broadcast, weights[v]]))
            following = builder.add(q, ir.Constant(intp, 1))
            body_end = builder.block
            builder.branch(header)
            q.add_incoming(following, body_end)
            for phi, value in zip(accs, updated):
                phi.add_incoming(value, body_end)

            builder.position_at_end(done)
            for r in range(rows):
                row_at = builder.add(acc_at, builder.mul(acc_stride, ir.Constant(intp, r)))
                for v in range(vectors):
                    at = builder.add(row_at, ir.Constant(intp, v * lanes))
                    store = builder.store(accs[r * vectors + v],
                                          builder.bitcast(builder.gep(acc_data, [at]), vec.as_pointer()))
                    store.align = 4
            return context.get_dummy_value()

        return sig, codegen

    return tile


def taps_kernel(positions: int):
    """The compiled depthwise step `taps(ring, rows, x_step, taps, w, w_at, acc, acc_at, acc_stride, x_at,
    x_stride)`:

        acc[acc_at + i * acc_stride + l] = sum_{r < len(rows), q < taps} dpbusd(ring bytes at rows[r] + x_at
                          + i * x_stride + q * x_step + 4l, w bytes at w_at + ((r * taps + q) * LANES + l) * 4)

    for i < `positions`, l < LANES: one vector of LANES channels of `positions` output pixels, each the sum of
    len(rows) x taps quads (4 kernel taps of a channel per 32-bit lane; ring: flat uint8 rows of quads, rows:
    int64 byte offsets of the kernel rows' quad rows, w: flat int8 quads of the weight, acc: flat int32; no
    bounds check)."""
    lanes = LANES

    @intrinsic
    def taps(typingctx, ring, rows, x_step, count, w, w_at, acc, acc_at, acc_stride, x_at, x_stride):
        if not (_is_flat(ring, types.uint8) and _is_flat(rows, types.int64) and _is_flat(w, types.int8)
                and _is_flat(acc, types.int32)):
            return None
        sig = types.none(ring, rows, types.intp, types.intp, w, types.intp, acc, types.intp, types.intp, types.intp,
                         types.intp)

        def codegen(context, builder, signature, args):
            ring_arr, rows_arr, x_step, count, w_arr, w_base, acc_arr, acc_at, acc_stride, x_at, x_stride = args
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            vec = ir.VectorType(i32, lanes)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                                _INTRINSIC[lanes])
            rows_ary = context.make_array(signature.args[1])(context, builder, rows_arr)
            ring_data = context.make_array(signature.args[0])(context, builder, ring_arr).data
            w_data = builder.gep(context.make_array(signature.args[4])(context, builder, w_arr).data, [w_base])
            acc_data = context.make_array(signature.args[6])(context, builder, acc_arr).data
            kernel_rows = builder.extract_value(rows_ary.shape, 0)
            one = ir.Constant(intp, 1)
            zero = ir.Constant(vec, [0] * lanes)
            starts = [builder.add(x_at, builder.mul(x_stride, ir.Constant(intp, i))) for i in range(positions)]

            entry = builder.block
            row_head = builder.append_basic_block("taps.row")
            quad_head = builder.append_basic_block("taps.quad")
            quad_body = builder.append_basic_block("taps.quad_body")
            row_next = builder.append_basic_block("taps.row_next")
            done = builder.append_basic_block("taps.done")
            builder.branch(row_head)

            # for r in range(len(rows)):
            builder.position_at_end(row_head)
            r = builder.phi(intp)
            r.add_incoming(ir.Constant(intp, 0), entry)
            row_accs = [builder.phi(vec) for _ in range(positions)]
            for phi in row_accs:
                phi.add_incoming(zero, entry)
            row_ok = builder.icmp_signed("<", r, kernel_rows)
            builder.cbranch(row_ok, quad_head, done)

            # for q in range(count):
            builder.position_at_end(quad_head)
            q = builder.phi(intp)
            q.add_incoming(ir.Constant(intp, 0), row_head)
            accs = [builder.phi(vec) for _ in range(positions)]
            for phi, start in zip(accs, row_accs):
                phi.add_incoming(start, row_head)
            builder.cbranch(builder.icmp_signed("<", q, count), quad_body, row_next)

            builder.position_at_end(quad_body)
            row_at = builder.load(builder.gep(rows_ary.data, [r]))
            tap = builder.add(builder.mul(r, count), q)
            w_at = builder.mul(tap, ir.Constant(intp, lanes * QUAD))
            weight = builder.load(builder.bitcast(builder.gep(w_data, [w_at]), vec.as_pointer()))
            weight.align = 1
            base = builder.add(row_at, builder.mul(q, x_step))
            updated = []
            for i in range(positions):
                at = builder.add(base, starts[i])
                xv = builder.load(builder.bitcast(builder.gep(ring_data, [at]), vec.as_pointer()))
                xv.align = 1
                updated.append(builder.call(fn, [accs[i], xv, weight]))
            following = builder.add(q, one)
            body_end = builder.block
            builder.branch(quad_head)
            q.add_incoming(following, body_end)
            for phi, value in zip(accs, updated):
                phi.add_incoming(value, body_end)

            builder.position_at_end(row_next)
            next_row = builder.add(r, one)
            builder.branch(row_head)
            r.add_incoming(next_row, row_next)
            for phi, value in zip(row_accs, accs):
                phi.add_incoming(value, row_next)

            builder.position_at_end(done)
            for i in range(positions):
                at = builder.add(acc_at, builder.mul(acc_stride, ir.Constant(intp, i)))
                store = builder.store(row_accs[i], builder.bitcast(builder.gep(acc_data, [at]), vec.as_pointer()))
                store.align = 4
            return context.get_dummy_value()

        return sig, codegen

    return taps
