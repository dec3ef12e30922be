"""Compact tensors for lean QAT (:mod:`qdsl.qat.lean_adam`): packed codes, 8-bit moments, stochastic rounding.

Everything here works on *row blocks* (a slice of output channels ``[r0, r1)`` of a
``[rows, cols]`` weight), so the training step can walk a weight a few rows at a time and
never hold a full-size float temporary:

* :func:`pack_rows` / :func:`unpack_rows`: integer codes in ``[qmin, qmax]`` as uint8,
  ``code − qmin`` per byte, or two per byte (low nibble first) when the range spans at most
  16 values (4-bit codes).  Rows are packed independently (an odd row length ends in a
  half-used byte), so a row block is a plain slice of the packed tensor.
* :class:`BlockQuantized`: a float tensor (an Adam moment) held in 8 bits per value, as
  8-bit Adam does (Dettmers et al., "8-bit optimizers via block-wise quantization"): every
  block of ``BLOCK`` consecutive values in a row keeps one float32 ``absmax`` and each value
  an 8-bit code of ``value / absmax``.  The code map is ours, not the paper's dynamic tree:
  a square-root companding (``code = round(127·sign(u)·sqrt|u|)``, decoded ``sign·(code/127)²``,
  for a signed tensor such as the first moment; ``round(255·u^¼)``, decoded ``(code/255)⁴``,
  for a non-negative one such as the second moment, whose square root Adam divides by).
  Both spend their levels near zero, where most moments sit, and keep 0 exact.  1 B per
  value plus 4 B per block (``BLOCK = 256``: 1.016 B per value, vs 4 B in float32).
* :func:`round_bf16_stochastic`: float32 -> bfloat16 with stochastic rounding (an
  unbiased update of a bf16 master: nearest rounding would drop every update smaller
  than half a bf16 step, 2^-9 of the weight).
* :func:`stochastic_codes`: ``floor(v + u)``, ``u ~ U[0, 1)``: the expected code is ``v``
  (the update of codes held without any float master).
* :class:`RandomBits`: the random bits both roundings take, drawn cheaply (drawing 1M
  fresh int32 from torch's CPU generator costs more than the rest of a block's update).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "pack_rows", "unpack_rows", "packed_cols", "BlockQuantized", "RandomBits",
           "round_bf16_stochastic", "stochastic_codes"]

BLOCK = 256
"""Values per block of a :class:`BlockQuantized` row (one float32 absmax each)."""


def _nibbles(qmin: int, qmax: int) -> bool:
    if qmax - qmin > 255:
        raise ValueError(f"packed codes hold at most 8-bit ranges, not [{qmin}, {qmax}]")
    return qmax - qmin <= 15


def packed_cols(cols: int, qmin: int, qmax: int) -> int:
    """Bytes per packed row of ``cols`` codes."""
    return (cols + 1) // 2 if _nibbles(qmin, qmax) else cols


def pack_rows(codes: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``[rows, cols]`` integer codes in ``[qmin, qmax]`` -> ``[rows, packed_cols]`` uint8.

    >>> c = torch.tensor([[-7, 7, 0], [1, -1, 3]])
    >>> p = pack_rows(c, -7, 7); p.shape
    torch.Size([2, 2])
    >>> unpack_rows(p, 3, -7, 7).tolist()
    [[-7, 7, 0], [1, -1, 3]]
    """
    u = (codes.to(torch.int16) - qmin).to(torch.uint8)
    if not _nibbles(qmin, qmax):
        return u.contiguous()
    if u.shape[1] % 2:
        u = torch.cat([u, u.new_zeros(u.shape[0], 1)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_rows(packed: torch.Tensor, cols: int, qmin: int, qmax: int,
                dtype: torch.dtype = torch.int16) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``[rows, cols]`` codes as ``dtype`` (float32 for the
    dequantization, which needs no integer copy: codes below 2^24 are exact floats)."""
    if _nibbles(qmin, qmax):
        u = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(packed.shape[0], -1)[:, :cols]
    else:
        u = packed
    return u.to(dtype) + qmin


class BlockQuantized:
    """A ``[rows, cols]`` float tensor held as 8-bit codes with a float32 absmax per block
    of :data:`BLOCK` values of a row (see the module docstring).  ``signed`` picks the code
    map; :meth:`read` / :meth:`write` work on a row block ``[r0, r1)``.

    >>> m = BlockQuantized(2, 3, signed=True)
    >>> m.write(0, 2, torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.02, -0.5]]))
    >>> [[round(v, 3) for v in row] for row in m.read(0, 2).tolist()]
    [[0.502, -1.0, 0.0], [2.0, 0.021, -0.508]]
    """

    def __init__(self, rows: int, cols: int, *, signed: bool, device=None) -> None:
        self.rows, self.cols, self.signed = rows, cols, signed
        self.blocks = -(-cols // BLOCK)
        dt = torch.int8 if signed else torch.uint8
        self.codes = torch.zeros(rows, self.blocks * BLOCK, dtype=dt, device=device)
        self.absmax = torch.zeros(rows, self.blocks, dtype=torch.float32, device=device)

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.absmax.numel() * 4

    def read(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` as float32."""
        c = self.codes[r0:r1].to(torch.float32).reshape(r1 - r0, self.blocks, BLOCK)
        if self.signed:
            u = c.abs().mul_(c).div_(127.0 * 127.0)  # sign(c)·(c/127)²
        else:
            u = c.div_(255.0).square_().square_()
        u.mul_(self.absmax[r0:r1].unsqueeze(2))
        return u.reshape(r1 - r0, -1)[:, :self.cols]

    def write(self, r0: int, r1: int, x: torch.Tensor) -> None:
        """Store float rows ``x`` (shape ``[r1 − r0, cols]``) at rows ``[r0, r1)``."""
        n = r1 - r0
        pad = self.blocks * BLOCK - self.cols
        x = x.to(torch.float32)
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        x = x.reshape(n, self.blocks, BLOCK)
        if self.signed:
            lo, hi = torch.aminmax(x, dim=2)  # one pass, no |x| temporary
            amax = torch.maximum(-lo, hi)
        else:
            amax = x.amax(dim=2)
        self.absmax[r0:r1] = amax
        u = x / amax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2)
        if self.signed:
            c = u.abs().sqrt_().mul_(127.0).round_().copysign_(u)
        else:
            c = u.clamp_min_(0.0).sqrt_().sqrt_().mul_(255.0).round_()
        self.codes[r0:r1] = c.reshape(n, -1).to(self.codes.dtype)


class RandomBits:
    """Random int32 words for up to ``n`` values per call: a window at a random offset into
    a table of ``2n`` random words drawn once, XOR-ed with one fresh random word per call.

    For any fixed element the result is uniform over calls (XOR with a uniform word is a
    bijection), and within a call elements read independent table entries; what is given
    up is only independence between calls for a pair of elements (their XOR difference
    repeats when the window offset does), which unbiased rounding does not need.

    >>> r = RandomBits(1000, torch.Generator().manual_seed(0))
    >>> b = r.take((10, 50)); b.shape, b.dtype
    (torch.Size([10, 50]), torch.int32)
    """

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator
        self.table = torch.randint(-2 ** 31, 2 ** 31 - 1, (2 * n,), dtype=torch.int32, generator=generator)

    def take(self, shape) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        if numel > self.n:
            return torch.randint(-2 ** 31, 2 ** 31 - 1, tuple(shape), dtype=torch.int32, generator=self.generator)
        off, word = torch.randint(0, 2 ** 31 - 1, (2,), generator=self.generator).tolist()
        off %= self.n + 1
        return torch.bitwise_xor(self.table[off:off + numel], word).reshape(shape)


def round_bf16_stochastic(x: torch.Tensor, generator: torch.Generator | None = None,
                          bits: torch.Tensor | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction.

    bfloat16 is the top half of a float32's bits: adding a uniform random 16-bit integer to
    the low half and truncating rounds up exactly when the carry reaches the kept half, with
    probability (dropped bits)/2^16 (finite values; a carry into the exponent is the correct
    next value).  ``bits``: random int32 words of ``x``'s shape (default: drawn from
    ``generator``); their low 16 bits are used.

    >>> x = torch.full((20000,), 1.0 + 2.0 ** -10)   # a quarter of a bf16 step above 1
    >>> y = round_bf16_stochastic(x, torch.Generator().manual_seed(0)).float()
    >>> sorted(set(y.tolist())), abs(float(y.mean()) - float(x[0])) < 2e-4
    ([1.0, 1.0078125], True)
    """
    xi = x.to(torch.float32).contiguous().view(torch.int32)
    if bits is None:
        noise = torch.randint(0, 1 << 16, xi.shape, dtype=torch.int32, device=xi.device, generator=generator)
    else:
        noise = bits & 0xFFFF
    out = noise.add_(xi).bitwise_and_(-65536)  # 0xFFFF0000 as a signed int32
    return out.view(torch.float32).to(torch.bfloat16)


def stochastic_codes(v: torch.Tensor, generator: torch.Generator | None = None,
                     bits: torch.Tensor | None = None) -> torch.Tensor:
    """``floor(v + u)`` with ``u ~ U[0, 1)`` per element (float result): ``E[result] = v``.
    ``u`` comes from ``bits`` (random int32 words of ``v``'s shape; their low 24 bits) when
    given, else from ``generator``.

    >>> v = torch.full((40000,), 2.25)
    >>> c = stochastic_codes(v, torch.Generator().manual_seed(0))
    >>> sorted(set(c.tolist())), abs(float(c.mean()) - 2.25) < 0.01
    ([2.0, 3.0], True)
    """
    if bits is None:
        u = torch.rand(v.shape, dtype=torch.float32, device=v.device, generator=generator)
    else:
        u = (bits & 0xFFFFFF).to(torch.float32).mul_(2.0 ** -24)
    return u.add_(v).floor_()
