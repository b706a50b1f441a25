"""The Transformer++ model (mixer "attention") against a real peer: transformers'
LlamaForCausalLM (its PyTorch path, float32 on CPU) holding the same weights gives the same
logits, the same logits per document of a packed row, and the same greedy continuation through
our key-value cache. Llama is the architecture the zoo's Transformer++ is meant to be: pre-norm
RMSNorm blocks, rotary positions (rotate-half), SwiGLU, a final RMSNorm, tied embeddings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extras install the CPU build
import transformers
from flax import nnx

from palimpsa_jax.models import CausalLM, ModelConfig, generate

VOCAB, D_MODEL, HEADS, HEAD_DIM, HIDDEN = 97, 32, 4, 8, 48
CASES = {"theta-1e4-eps-1e-5": dict(rope_theta=1e4, norm_eps=1e-5),
         "theta-500-eps-1e-3": dict(rope_theta=500.0, norm_eps=1e-3)}


def _models(rope_theta: float, norm_eps: float):
    """Our float32 CausalLM (2 attention blocks) with every parameter perturbed off its init,
    and a LlamaForCausalLM holding the same values."""
    config = ModelConfig(vocab_size=VOCAB, d_model=D_MODEL, mixers=("attention",), n_layers=2,
                         num_heads=HEADS, head_dim=HEAD_DIM, mlp_hidden=HIDDEN, norm_eps=norm_eps,
                         rope_theta=rope_theta, backend="xla")
    ours = CausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    leaves, treedef = jax.tree.flatten(nnx.state(ours, nnx.Param))
    nnx.update(ours, jax.tree.unflatten(treedef, [
        jnp.asarray(x + 0.2 * rng.standard_normal(x.shape), jnp.float32) for x in leaves]))
    peer = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=norm_eps, rope_theta=rope_theta, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).float().eval()
    linear = lambda layer: torch.from_numpy(np.asarray(layer.kernel[...]).T.copy())   # (out, in)
    scale = lambda norm: torch.from_numpy(np.asarray(norm.scale[...]).copy())
    weights = {"model.embed_tokens.weight": torch.from_numpy(np.asarray(ours.embed.embedding[...]).copy()),
               "model.norm.weight": scale(ours.norm)}
    for i, block in enumerate(ours.blocks):
        layer = f"model.layers.{i}."
        weights |= {layer + "input_layernorm.weight": scale(block.mixer_norm),
                    layer + "post_attention_layernorm.weight": scale(block.mlp_norm),
                    layer + "self_attn.q_proj.weight": linear(block.mixer.W_q),
                    layer + "self_attn.k_proj.weight": linear(block.mixer.W_k),
                    layer + "self_attn.v_proj.weight": linear(block.mixer.W_v),
                    layer + "self_attn.o_proj.weight": linear(block.mixer.W_o),
                    layer + "mlp.gate_proj.weight": linear(block.mlp.W_gate),
                    layer + "mlp.up_proj.weight": linear(block.mlp.W_up),
                    layer + "mlp.down_proj.weight": linear(block.mlp.W_down)}
    missing, unexpected = peer.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    peer.tie_weights()
    assert torch.equal(peer.lm_head.weight, weights["model.embed_tokens.weight"])
    return ours, peer


def _peer_logits(peer, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return peer(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def models(request):
    return _models(**CASES[request.param])


def test_logits_equal_llama(models):
    ours, peer = models
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 37)).astype(np.int32)
    logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(ours, jnp.asarray(tokens)))
    np.testing.assert_allclose(logits, _peer_logits(peer, tokens), rtol=2e-4, atol=2e-4)


def test_packed_documents_equal_llama_run_on_each(models):
    """Segment ids restart the positions (RoPE) and cut attention at document boundaries: each
    document of a packed row gets the logits the peer gives it alone."""
    ours, peer = models
    lengths = (11, 20, 6)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (1, sum(lengths))).astype(np.int32)
    segment_ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None].astype(np.int32)
    logits = np.asarray(nnx.jit(lambda m, t, s: m(t, segment_ids=s)[0])(
        ours, jnp.asarray(tokens), jnp.asarray(segment_ids)))
    starts = np.cumsum((0,) + lengths)
    for start, end in zip(starts[:-1], starts[1:]):
        np.testing.assert_allclose(logits[:, start:end], _peer_logits(peer, tokens[:, start:end]),
                                   rtol=2e-4, atol=2e-4)


def test_greedy_continuation_equals_llama(models):
    """Prefill then one token at a time through our key-value cache, against the peer's greedy
    generate (its own cache)."""
    ours, peer = models
    prompt = np.random.default_rng(4).integers(0, VOCAB, (2, 9)).astype(np.int32)
    new = 12
    continuation = np.asarray(generate(ours, jnp.asarray(prompt), new, temperature=0.0))
    with torch.no_grad():
        expected = peer.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False)[:, prompt.shape[1]:].numpy()
    np.testing.assert_array_equal(continuation, expected)
