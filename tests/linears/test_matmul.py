"""Chunk matmuls into strided views, and the matmul_soc_friendly layout (NPU path forced on CPU)."""

import pytest
import torch

from coc_inject.pipeline.matmul import MatmulLayout, matmul_into, padded_k, pads


@pytest.mark.parametrize("k,itemsize,expected", [(256, 2, 256), (257, 2, 512), (1000, 2, 1024),
                                                 (128, 4, 128), (129, 4, 256), (1, 1, 512)])
def test_padded_k_is_the_next_512_byte_multiple(k, itemsize, expected):
    assert padded_k(k, itemsize) == expected
    assert padded_k(k, itemsize) * itemsize % 512 == 0


def test_pads_only_inside_the_window_and_when_unaligned():
    assert pads(1100, 2, 1024, 4096)
    assert not pads(1024, 2, 1024, 4096)  # already aligned
    assert not pads(1000, 2, 1024, 4096)  # below k_min
    assert not pads(5000, 2, 1024, 4096)  # above k_max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1100, 1024, 300])
def test_npu_layout_gives_the_same_product(dtype, k):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, k, generator=generator).to(dtype)
    x = torch.randn(2, 10, k, generator=generator).to(dtype)
    matmul = MatmulLayout(True, 1024, 4096).forward_matmul(weight, "npu")
    expected_pad = padded_k(k, weight.element_size()) - k if 1024 <= k <= 4096 else 0
    assert matmul.pad == expected_pad and matmul.weight_t.is_contiguous()
    out = torch.full((2, 20, 24), float("nan"), dtype=dtype)
    strided_chunk = x[:, 3:8]
    matmul(strided_chunk, out=out[:, 4:9])  # strided input and output views, as the pipeline uses
    reference = torch.matmul(strided_chunk.float(), weight.float().t())
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert ((out[:, 4:9].float() - reference).abs().max() / reference.abs().max()).item() <= tolerance
    assert torch.isnan(out[:, :4]).all() and torch.isnan(out[:, 9:]).all()  # nothing else written


@pytest.mark.parametrize("enabled,device", [(False, "npu"), (True, "cpu"), (True, "cuda")])
def test_no_op_off_npu_or_when_disabled(enabled, device):
    weight = torch.randn(8, 1100)
    matmul = MatmulLayout(enabled, 1024, 4096).forward_matmul(weight, device)
    assert matmul.pad == 0 and not matmul.contiguous
    assert matmul.weight_t.data_ptr() == weight.data_ptr()  # no copy of the weight


@pytest.mark.parametrize("contiguous_input", [True, False])
def test_matmul_into_a_strided_chunk_view_writes_only_that_chunk(contiguous_input):
    # [TP=2, B=10, k] blocks; chunk rows 3:8 of every rank's block, as the SP pipeline uses.
    generator = torch.Generator().manual_seed(0)
    a_full = torch.randn(2, 10, 7, generator=generator)
    a = a_full[:, 3:8].contiguous() if contiguous_input else a_full[:, 3:8]
    b = torch.randn(7, 5, generator=generator)
    out = torch.full((2, 10, 5), float("nan"))
    result = matmul_into(a, b, out[:, 3:8])
    assert result.data_ptr() == out[:, 3:8].data_ptr()
    # The product, up to fp32 rounding of a 7-term sum (a strided BLAS path may add in another
    # order): a wrong chunk or a missing term is off by O(1), far outside this bound.
    torch.testing.assert_close(out[:, 3:8], (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[:, :3]).all() and torch.isnan(out[:, 8:]).all()
