"""Commands that launch no training run: `accel-data tokenize`, `shard` and `convert` (tokenize,
shard, convert;
outputs: how they write and replace their output), `accel-sample` (sample), `accel-report`
(report), and a multirun's per-job body and summary (sweep, sweep_summary). They sit above the
launchers: a sweep job and a report run trainings through them."""
