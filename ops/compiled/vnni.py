"""Integer dot products on the CPU's multiply-add instructions, as register tiles: the 8-bit VNNI `vpdpbusd`
where the CPU has it, the 16-bit `vpmaddwd` of AVX2 / AVX-512BW elsewhere.

Each 32-bit lane of a vector holds a group of E operands: E = 4 unsigned bytes of x and 4 signed bytes of w
for `vpdpbusd`, E = 2 16-bit values of each for `vpmaddwd`, and one instruction adds their products to the
lane's int32 accumulator:

    vpdpbusd:            acc[l] += a[4l] b[4l] + a[4l+1] b[4l+1] + a[4l+2] b[4l+2] + a[4l+3] b[4l+3]  (u8 x s8)
    vpmaddwd + vpaddd:   acc[l] += a[2l] b[2l] + a[2l+1] b[2l+1]                                    (s16 x s16)

With x an unsigned code (0..255, as a byte or zero-extended to 16 bits) and w an int8 (int16 for `vpmaddwd`)
value, every product and every group sum is exact (|sum| <= 4 * 255 * 128, resp. 2 * 255 * 32768 < 2^31;
the pair-saturating `vpmaddubsw` of plain AVX2 is not used), so the accumulator is the exact integer sum
modulo 2^32. A tile (`tile_kernel(rows, vectors)`) holds `rows` x `vectors` accumulators: lane l of vector v
of row r is output channel LANES * v + l of pixel r; per step q it broadcasts the group x[r, Eq:Eq+E] of each
row (4 bytes) and multiplies it against the packed weights w[g, q, l, 0:E] = w[LANES * g + l, Eq:Eq+E] (zero
past the last channel and the last input channel, `pack_weight`). After the K/E steps

    acc[r, m] = sum_k x[r, k] * w[m, k]   modulo 2^32,

which is the true sum when |sum| < 2^31; callers prove that from 255 * max_m sum_k |w[m, k]| < 2^31
(`ops.compiled.int_dense`). A signed int8 x is read as the unsigned code x + 128 (for `vpdpbusd` the sign bit
is flipped as each broadcast is formed, for `vpmaddwd` as the 16-bit rows are written); the caller folds
the 128 * sum_k w[m, k] it adds into its zero-point offset.

The instruction set is the one of the CPU numba compiles for (`NUMBA_CPU_NAME`/`NUMBA_CPU_FEATURES`, else the
host): AVX512-VNNI (16 lanes of a 512-bit vector), AVX-VNNI (8 lanes), AVX-512BW (16 lanes of `vpmaddwd`),
AVX2 (8 lanes); `LANES` is 0 on any other CPU and callers keep their other path. numba keys its on-disk cache
on that CPU, so a kernel compiled for one instruction set never runs on another.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANE_BYTES = 4  # the bytes of one operand group (one 32-bit lane)


def _target_features() -> set[str]:
    """The CPU features numba compiles for: the host's, unless NUMBA_CPU_NAME names another CPU (an
    explicit NUMBA_CPU_FEATURES then lists them; else none is assumed)."""
    name = numba.config.CPU_NAME
    if name and name != "host":
        listed = numba.config.CPU_FEATURES or ""
    else:
        listed = binding.get_host_cpu_features().flatten()
    return {f[1:] for f in listed.split(",") if f.startswith("+")}


def _instruction_set(features: set[str]) -> tuple[str, int, int]:
    """(LLVM intrinsic, lanes, operands per lane) of the best multiply-add the features offer; ("", 0, 0)
    for none."""
    if {"avx512f", "avx512vnni"} <= features:
        return "llvm.x86.avx512.vpdpbusd.512", 16, 4
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        return "llvm.x86.avx512.vpdpbusd.256", 8, 4
    if {"avx512f", "avx512bw"} <= features:
        return "llvm.x86.avx512.pmaddw.d.512", 16, 2
    if "avx2" in features:
        return "llvm.x86.avx2.pmadd.wd", 8, 2
    return "", 0, 0


INSTRUCTION, LANES, ELEMENTS = _instruction_set(_target_features())
# how a benchmark names it
INSTRUCTION_NAME = {"llvm.x86.avx512.vpdpbusd.512": "vpdpbusd, AVX512-VNNI, 16 lanes",
                    "llvm.x86.avx512.vpdpbusd.256": "vpdpbusd, AVX-VNNI, 8 lanes",
                    "llvm.x86.avx512.pmaddw.d.512": "vpmaddwd, AVX-512BW, 16 lanes",
                    "llvm.x86.avx2.pmadd.wd": "vpmaddwd, AVX2, 8 lanes"}.get(INSTRUCTION, "none")
# the weight's dtype: signed bytes for vpdpbusd, int16 for vpmaddwd (ELEMENTS 0: no kernel)
WEIGHT_DTYPE = np.dtype(np.int8 if ELEMENTS == 4 else np.int16)
WEIGHT_RANGE = (int(np.iinfo(WEIGHT_DTYPE).min), int(np.iinfo(WEIGHT_DTYPE).max))


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """The weight (M, K) (values in WEIGHT_RANGE) as WEIGHT_DTYPE (G, Q, LANES, E), G = ceil(M / LANES),
    Q = ceil(K / E): packed[g, q, l, j] = weight[g * LANES + l, E * q + j], zero where that is past M or K."""
    m, k = weight.shape
    groups, quads = -(-m // LANES), -(-k // ELEMENTS)
    padded = np.zeros((groups * LANES, quads * ELEMENTS), dtype=WEIGHT_DTYPE)
    padded[:m, :k] = weight
    return np.ascontiguousarray(padded.reshape(groups, LANES, quads, ELEMENTS).transpose(0, 2, 1, 3))


def _multiply_add(builder, fn, acc, a, b):
    """acc + the lane sums of a * b (module docstring), a and b vectors of int32 lanes."""
    if ELEMENTS == 4:
        return builder.call(fn, [acc, a, b])
    pairs = ir.VectorType(ir.IntType(16), 2 * LANES)
    return builder.add(acc, builder.call(fn, [builder.bitcast(a, pairs), builder.bitcast(b, pairs)]))


def _intrinsic_fn(builder):
    vec = ir.VectorType(ir.IntType(32), LANES)
    if ELEMENTS == 4:
        fnty = ir.FunctionType(vec, [vec, vec, vec])
    else:
        pairs = ir.VectorType(ir.IntType(16), 2 * LANES)
        fnty = ir.FunctionType(vec, [pairs, pairs])
    return cgutils.get_or_insert_function(builder.module, fnty, INSTRUCTION)


_WEIGHT_TYPE = {1: types.int8, 2: types.int16}


def _is_flat(arr, dtype) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == dtype and arr.ndim == 1 and arr.layout == "C"


def tile_kernel(rows: int, vectors: int):
    """The compiled tile `tile(x, x_at, x_stride, flip, w, w_at, w_stride, quads, acc, acc_at, acc_stride)`:

        acc[acc_at + r * acc_stride + v * LANES + l] = sum_{q < quads, j < E} xq[r, q, j]
                                                          * w[w_at + v * w_stride + (q * LANES + l) * E + j]

    for r < rows, v < vectors, l < LANES, where xq[r, q] is the 4-byte group at x[x_at + r * x_stride + 4q]
    (^ flip) read as E operands (x: flat uint8, the bytes of uint8 codes or of uint16 ones; w: flat, packed by
    `pack_weight`; acc: flat int32; flip 0x80808080 reads int8 bytes as x + 128, else 0; no bounds check: the
    caller keeps every index inside)."""
    lanes = LANES

    @intrinsic
    def tile(typingctx, x, x_at, x_stride, flip, w, w_at, w_stride, quads, acc, acc_at, acc_stride):
        if not (_is_flat(x, types.uint8) and _is_flat(w, _WEIGHT_TYPE[WEIGHT_DTYPE.itemsize])
                and _is_flat(acc, types.int32)):
            return None
        sig = types.none(x, types.intp, types.intp, types.uint32, w, types.intp, types.intp, types.intp, acc,
                         types.intp, types.intp)

        def codegen(context, builder, signature, args):
            x_arr, x_at, x_stride, flip, w_arr, w_at, w_stride, quads, acc_arr, acc_at, acc_stride = args
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            vec = ir.VectorType(i32, lanes)
            fn = _intrinsic_fn(builder)
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
            byte_at = builder.mul(q, ir.Constant(intp, LANE_BYTES))
            weights = []
            for v in range(vectors):
                at = builder.mul(q, ir.Constant(intp, lanes * ELEMENTS))
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
                    updated.append(_multiply_add(builder, fn, accs[r * vectors + v], broadcast, weights[v]))
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


def taps_kernel(positions: int, unrolled: Optional[tuple[int, int]] = None):
    """The compiled depthwise step `taps(ring, rows, x_step, taps, w, w_at, acc, acc_at, acc_stride, x_at,
    x_stride)`:

        acc[acc_at + i * acc_stride + l] = sum_{r < len(rows), q < taps} the lane sum (module docstring) of
            the group at ring byte rows[r] + x_at + i * x_stride + q * x_step + 4l
            and the group at w element w_at + ((r * taps + q) * LANES + l) * E

    for i < `positions`, l < LANES: one vector of LANES channels of `positions` output pixels, each the sum of
    len(rows) x taps groups (E kernel taps of a channel per 32-bit lane; ring: flat uint8, the bytes of the
    rows of groups, rows: int64 byte offsets of the kernel rows' group rows, w: the flat packed weight, acc:
    flat int32; no bounds check). `unrolled` (kernel rows, groups per row): the loops straight-line for that
    kernel size, which the caller then guarantees (3 x 1 for a 3x3 kernel on vpdpbusd)."""
    lanes = LANES

    @intrinsic
    def taps(typingctx, ring, rows, x_step, count, w, w_at, acc, acc_at, acc_stride, x_at, x_stride):
        if not (_is_flat(ring, types.uint8) and _is_flat(rows, types.int64)
                and _is_flat(w, _WEIGHT_TYPE[WEIGHT_DTYPE.itemsize]) and _is_flat(acc, types.int32)):
            return None
        sig = types.none(ring, rows, types.intp, types.intp, w, types.intp, acc, types.intp, types.intp, types.intp,
                         types.intp)

        def codegen(context, builder, signature, args):
            ring_arr, rows_arr, x_step, count, w_arr, w_base, acc_arr, acc_at, acc_stride, x_at, x_stride = args
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            vec = ir.VectorType(i32, lanes)
            fn = _intrinsic_fn(builder)
            rows_ary = context.make_array(signature.args[1])(context, builder, rows_arr)
            ring_data = context.make_array(signature.args[0])(context, builder, ring_arr).data
            w_data = builder.gep(context.make_array(signature.args[4])(context, builder, w_arr).data, [w_base])
            acc_data = context.make_array(signature.args[6])(context, builder, acc_arr).data
            kernel_rows = builder.extract_value(rows_ary.shape, 0)
            one = ir.Constant(intp, 1)
            zero = ir.Constant(vec, [0] * lanes)
            starts = [builder.add(x_at, builder.mul(x_stride, ir.Constant(intp, i))) for i in range(positions)]
            if unrolled is not None:
                accs = [zero] * positions
                for r in range(unrolled[0]):
                    row_at = builder.load(builder.gep(rows_ary.data, [ir.Constant(intp, r)]))
                    for q in range(unrolled[1]):
                        w_at = ir.Constant(intp, (r * unrolled[1] + q) * lanes * ELEMENTS)
                        weight = builder.load(builder.bitcast(builder.gep(w_data, [w_at]), vec.as_pointer()))
                        weight.align = 1
                        base = builder.add(row_at, builder.mul(ir.Constant(intp, q), x_step))
                        for i in range(positions):
                            xv = builder.load(builder.bitcast(builder.gep(ring_data, [builder.add(base, starts[i])]),
                                                              vec.as_pointer()))
                            xv.align = 1
                            accs[i] = _multiply_add(builder, fn, accs[i], xv, weight)
                for i in range(positions):
                    at = builder.add(acc_at, builder.mul(acc_stride, ir.Constant(intp, i)))
                    builder.store(accs[i], builder.bitcast(builder.gep(acc_data, [at]), vec.as_pointer())).align = 4
                return context.get_dummy_value()

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
            w_at = builder.mul(tap, ir.Constant(intp, lanes * ELEMENTS))
            weight = builder.load(builder.bitcast(builder.gep(w_data, [w_at]), vec.as_pointer()))
            weight.align = 1
            base = builder.add(row_at, builder.mul(q, x_step))
            updated = []
            for i in range(positions):
                at = builder.add(base, starts[i])
                xv = builder.load(builder.bitcast(builder.gep(ring_data, [at]), vec.as_pointer()))
                xv.align = 1
                updated.append(_multiply_add(builder, fn, accs[i], xv, weight))
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
