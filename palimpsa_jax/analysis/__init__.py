"""Looking inside trained models: load a run (`load_run`), probe its memories (`probe`,
`inspect`), and measure priors against posteriors (`measures`), the uncertainty's meaning
(`uncertainty`), and a run's report (`report`, the palimpsa-analyze command)."""
from palimpsa_jax.analysis import measures, uncertainty
from palimpsa_jax.analysis.posterior import (
                                             LayerMemory,
                                             final_posterior,
                                             inspect,
                                             mean_importance,
                                             posterior_at,
                                             predictive_variance,
)
from palimpsa_jax.analysis.probe import Probe, probe
from palimpsa_jax.analysis.run import Run, checkpoint_steps, load_run

__all__ = ["LayerMemory", "Probe", "Run", "checkpoint_steps", "final_posterior", "inspect",
           "load_run", "mean_importance", "measures", "posterior_at", "predictive_variance",
           "probe", "uncertainty"]
