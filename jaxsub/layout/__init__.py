"""Layout and configuration selection (the paper's last step, issue #6).

For every operator of a layer, choose among candidates (input layout, output layout,
algorithm/kernel configuration) so that the layer's forward + backward time, transposes
between operators included, is smallest: a shortest path through a layered DAG whose
edge weights are measured on the GPU (or modelled, `layouts="heuristic"`), cached on disk.

  shortest_configuration(stages, transpose_cost)   the pure solver
  EncoderProblem(LayerSpec(...))                    the encoder layer's eight stages
  AttentionProblem(signature)                       one attention call (jaxsub.optimize)
  resolve(layouts, problem) -> Selection            "auto" | "heuristic" | "none" | Auto(...) | Selection
  tune(problem) / model_tables(problem) / solve(problem, tables, source)
  use(...)                                          the op-configuration context (jaxsub.ops.config)

See README.md ("Layout selection") for what `jaxsub.optimize(fn, layouts=...)` and
`jaxsub.flax.EncoderLayer(layouts=...)` each apply.
"""

from jaxsub.layout import cache
from jaxsub.layout.attention import AttentionProblem
from jaxsub.layout.encoder import STAGE_NAMES, EncoderProblem, LayerSpec
from jaxsub.layout.problem import Candidate, Choice, Problem, Selection, Stage, Workload
from jaxsub.layout.select import Auto, clear_memo, gpu_present, resolve
from jaxsub.layout.solver import NoConfigurationError, ShortestPath, path_cost, shortest_configuration
from jaxsub.layout.tuning import Tables, measure, model_tables, solve, tune
from jaxsub.ops.config import use

__all__ = [
    "shortest_configuration", "path_cost", "ShortestPath", "NoConfigurationError",
    "Candidate", "Choice", "Stage", "Workload", "Problem", "Selection",
    "LayerSpec", "EncoderProblem", "STAGE_NAMES", "AttentionProblem",
    "Auto", "resolve", "clear_memo", "gpu_present",
    "Tables", "tune", "measure", "model_tables", "solve", "use", "cache",
]
