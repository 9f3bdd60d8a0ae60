"""Post-hoc synthesis: rebuild the EMA of any length from a folder of snapshots.

* `plan`: choose the snapshots and solve the weights from their headers
  (`plan_synthesis()`, `SynthesisPlan`), and run a plan into a state dict
  (`synthesize()`) or into a model's tensors, whole or sharded;
* `weighted_sum`: the one streamed weighted sum of the snapshots' tensors, for one target
  or many at once, whole tensors or a rank's blocks;
* `sweep`: many lengths in one pass over the snapshots, each scored (`sweep()`,
  `SweepResult`).
"""
