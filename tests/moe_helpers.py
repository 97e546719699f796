"""What the mixture-of-experts model tests share (test_moe_model.py, test_moe_stats.py, test_moe_compile.py)."""


def moe_tiny(**overrides):
    """test_engine's Llama with 4 experts of width 48, top-2, a z-loss too."""
    from test_engine import tiny

    return tiny(
        **{
            "num_experts": 4,
            "moe_top_k": 2,
            "moe_ffn_hidden_size": 48,
            "moe_z_loss_coef": 1e-3,
            **overrides,
        }
    )


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}
