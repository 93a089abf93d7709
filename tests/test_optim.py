"""Optimizers and the LR schedule shared by the jobs."""

import math

import pytest
import torch

from rl_core.optim import TFAdam, build_optimizer, linear_anneal_schedule


# --------------------------------------------------------------------------- optimizer and schedule


def test_tf_adam_matches_seed_formula_over_two_steps():
    lr, (beta1, beta2), eps = 0.1, (0.9, 0.999), 1e-5
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = TFAdam([param], lr=lr, betas=(beta1, beta2), eps=eps)
    grads = [torch.tensor([0.5, -0.01], dtype=torch.float64), torch.tensor([0.3, 0.02], dtype=torch.float64)]
    expected, m, v = param.detach().clone(), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    after_first_step = None
    for step, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        optimizer.step()
        after_first_step = param[0].item() if after_first_step is None else after_first_step
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad**2
        lr_t = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        expected = expected - lr_t * m / (v.sqrt() + eps)
        torch.testing.assert_close(param.detach(), expected)
    # First step by hand: m = 0.1 g, v = 0.001 g^2, lr_t = 0.1 sqrt(0.001) / 0.1
    # -> TF step = 0.1 g / (|g| + eps / sqrt(0.001)), PyTorch step = 0.1 g / (|g| + eps)
    torch_adam_param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    torch_adam = torch.optim.Adam([torch_adam_param], lr=lr, betas=(beta1, beta2), eps=eps)
    torch_adam_param.grad = grads[0].clone()
    torch_adam.step()
    tf_first = 1.0 - 0.1 * 0.5 / (0.5 + eps / math.sqrt(1 - beta2))
    torch_first = 1.0 - 0.1 * 0.5 / (0.5 + eps)
    assert after_first_step == pytest.approx(tf_first, abs=1e-12)
    assert torch_adam_param[0].item() == pytest.approx(torch_first, abs=1e-12)
    assert tf_first != pytest.approx(torch_first, abs=1e-6)  # the eps placement matters


def test_build_optimizer_names():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(build_optimizer(params, "tf_adam", lr=1e-3), TFAdam)
    assert isinstance(build_optimizer(params, "adamw", lr=1e-3, weight_decay=0.1), torch.optim.AdamW)
    with pytest.raises(ValueError, match="tf_adam"):
        build_optimizer(params, "sgd", lr=1e-3)


@pytest.mark.parametrize("warmup", [0, 3])
def test_linear_anneal_reaches_zero_at_the_end(warmup):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = linear_anneal_schedule(optimizer, total_steps=10, warmup_steps=warmup)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert max(lrs) == pytest.approx(2.0)
    assert all(later <= earlier for earlier, later in zip(lrs[warmup:], lrs[warmup + 1:]))
    if warmup == 0:
        assert lrs == pytest.approx([2.0 * (1 - i / 10) for i in range(10)])
    else:
        assert lrs[:warmup] == pytest.approx([2.0 * (i + 1) / warmup for i in range(warmup)])


def test_a_finetune_run_shorter_than_its_warmup_is_one_line_naming_the_key():
    from rl_core.finetune import FinetuneTrainConfig, total_steps

    with pytest.raises(ValueError, match=r"train.warmup_steps=30 is not below the run's 10 steps"):
        total_steps(FinetuneTrainConfig(max_steps=10, warmup_steps=30, schedule="linear"), 640, "rows", "data")
    assert total_steps(FinetuneTrainConfig(max_steps=10, warmup_steps=30, schedule="constant"), 640, "rows", "data") \
        == (640 // FinetuneTrainConfig().batch_size, 10)
