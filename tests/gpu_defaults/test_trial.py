"""coc_inject.trial.isolated: what a trial may change comes back as it was (one process, no Megatron
job needed; the GPT runs of test_gpu_defaults.py observe the same in training)."""

import torch

from coc_inject import trial


def _linear():
    layer = torch.nn.Linear(4, 3)
    layer.gradient_accumulation_fusion = True
    layer.fuse_wgrad_accumulation = True  # TE's name
    main_grad = torch.arange(12, dtype=torch.float32).view(3, 4)
    layer.weight.main_grad = main_grad
    layer.weight.grad_added_to_main_grad = False
    grad = torch.ones(3)
    layer.bias.grad = grad
    return layer, main_grad, grad


def test_fusion_off_and_main_grad_away_inside_then_all_back():
    layer, main_grad, grad = _linear()
    outer = torch.nn.Sequential(layer)
    with trial.isolated([outer]):
        assert trial.active()
        assert layer.gradient_accumulation_fusion is False and layer.fuse_wgrad_accumulation is False
        assert not hasattr(layer.weight, "main_grad")  # a writer that did not ask fails loudly
        layer.weight.grad_added_to_main_grad = True
        layer.bias.grad = torch.zeros(3)
        layer.weight.grad = torch.zeros(3, 4)
    assert not trial.active()
    assert layer.gradient_accumulation_fusion is True and layer.fuse_wgrad_accumulation is True
    assert layer.weight.main_grad is main_grad and torch.equal(main_grad, torch.arange(12.0).view(3, 4))
    assert layer.weight.grad_added_to_main_grad is False
    assert layer.bias.grad is grad and layer.weight.grad is None


def test_restored_after_an_exception_and_nested():
    layer, main_grad, _ = _linear()
    try:
        with trial.isolated([layer]):
            with trial.isolated([layer]):
                assert trial.active() and not hasattr(layer.weight, "main_grad")
            assert trial.active() and layer.gradient_accumulation_fusion is False
            raise RuntimeError("a failing trial")
    except RuntimeError:
        pass
    assert not trial.active()
    assert layer.gradient_accumulation_fusion is True and layer.weight.main_grad is main_grad


def test_random_numbers_and_megatrons_tracker_as_found():
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    saved_states = dict(tracker.states_)
    generator = torch.Generator().manual_seed(5)  # a CUDA-graph-safe tracker keeps generators
    tracker.states_ = {"model-parallel-rng": torch.Generator().manual_seed(3).get_state(), "graph-safe": generator}
    try:
        expected_cpu = (torch.get_rng_state(), generator.get_state())
        with trial.isolated():
            torch.rand(5)
            torch.rand(5, generator=generator)
            tracker.states_["model-parallel-rng"] = torch.Generator().manual_seed(9).get_state()
            tracker.states_["added in the trial"] = torch.get_rng_state()
        assert torch.equal(torch.get_rng_state(), expected_cpu[0])
        assert torch.equal(generator.get_state(), expected_cpu[1])
        assert set(tracker.states_) == {"model-parallel-rng", "graph-safe"}
        assert tracker.states_["graph-safe"] is generator
        assert torch.equal(tracker.states_["model-parallel-rng"], torch.Generator().manual_seed(3).get_state())
    finally:
        tracker.states_ = saved_states
