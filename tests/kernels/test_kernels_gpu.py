"""GPU tests: each Triton kernel against its torch fallback on CUDA (skipped without a GPU)."""
import pytest
import torch

from tests.kernels._triton_checks import check_decode, check_fp8

pytestmark = pytest.mark.gpu


def test_fp8_triton_vs_fallback_cuda():
    pytest.importorskip("triton")
    check_fp8("cuda", shapes=((1, 2048, 2048), (96, 3072, 2048), (512, 5120, 2048), (300, 2048, 5120),
                              (4096, 4096, 4096), (77, 200, 330)))


def test_decode_triton_vs_fallback_cuda():
    pytest.importorskip("triton")
    check_decode("cuda", V=157184)


def test_model_fp8_on_cuda():
    model = pytest.importorskip("ebpo.model")
    from kernels.fp8 import convert_model_to_fp8
    torch.manual_seed(0)
    m = model.LLaDA2MoeModelLM(model.tiny_config()).cuda().bfloat16().eval()
    ids = torch.randint(0, m.config.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        ref = m(ids).logits.float()
        out = convert_model_to_fp8(m)(ids).logits.float()
    assert (out - ref).norm() / ref.norm() < 0.25


def test_logprobs_and_flex_cuda():
    from kernels.attention import attention, flex_block_mask
    from kernels.logprobs import token_logprobs
    from ebpo.model.masks import packed_noisy_clean_mask
    h = torch.randn(300, 256, device="cuda", requires_grad=True)
    w = torch.randn(5000, 256, device="cuda", requires_grad=True)
    t = torch.randint(0, 5000, (300,), device="cuda")
    out = token_logprobs(h, w, t, chunk_size=64)
    ref = torch.log_softmax(h @ w.t(), -1)[torch.arange(300, device="cuda"), t]
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    q, k, v = (torch.randn(2, 4, 3 * 64, 64, device="cuda") for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    bm = flex_block_mask("packed", 64, 32, 2, device="cuda")
    torch.testing.assert_close(attention(q, k, v, block_mask=bm),
                               attention(q, k, v, packed_noisy_clean_mask(64, 32, 2).cuda()), rtol=2e-3, atol=2e-3)
