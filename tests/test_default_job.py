"""The README's default job (experiments/mqar/palimpsa_d.py, the CPU MQAR job), shortened to
half its steps (a cosine over 250 instead of 500): it learns the task well above chance. The
full job ends at test accuracy >= 0.97 at 64 tokens (README "Quickstart", seeds 0-2); this
floor is what half of it clears with margin, not what it reaches."""
from palimpsa_jax.experiments.mqar import palimpsa_d
from palimpsa_jax.training import train_and_evaluate

STEPS = 250
FLOOR = 0.2        # chance is 1/64


def test_default_job_shortened_learns_the_task(tmp_path):
    config = palimpsa_d.get_config()
    assert (config.train.steps, config.batch_size, config.data.seq_len) == (500, 32, 64)
    config.train.steps = STEPS
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.log.update(diagnostics_every_steps=0, progress=False)
    final = train_and_evaluate(config, tmp_path)
    assert final["eval/seq64_pairs4/accuracy"] > FLOOR, final
