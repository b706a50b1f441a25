"""The README's default job (experiments/mqar/palimpsa_d.py, the CPU MQAR job), shortened to
half its steps (a cosine over 250 instead of 500): it learns the task well above chance.

Measured with seed 0 on 2 CPU cores: the shortened job ends at test accuracy 0.17 and loss 2.97
at 64 tokens (chance 1/64, initial loss ln 128 = 4.85), the full job at 0.70 (README
"Quickstart"); the floors are what the shortened job clears, not what the full one reaches."""
from palimpsa_jax.experiments.mqar import palimpsa_d
from palimpsa_jax.training import train_and_evaluate

STEPS = 250
ACCURACY_FLOOR = 0.1    # 6x chance
LOSS_CEILING = 3.6      # 1.25 nats below the initial loss


def test_default_job_shortened_learns_the_task(tmp_path):
    config = palimpsa_d.get_config()
    assert (config.train.steps, config.batch_size, config.data.seq_len) == (500, 32, 64)
    config.train.steps = STEPS
    config.eval.every_steps = 0
    config.checkpoint.every_steps = 0
    config.log.update(diagnostics_every_steps=0, progress=False)
    final = train_and_evaluate(config, tmp_path)
    assert final["eval/seq64_pairs4/accuracy"] > ACCURACY_FLOOR, final
    assert final["eval/seq64_pairs4/loss"] < LOSS_CEILING, final
