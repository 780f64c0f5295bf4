"""Attention of a pass's computed rows over a layer's whole K/V: the loop's job, not the model's.

`rows` holds what the loop calls: `rows.RowAttention` picks, per pass, plain causal attention,
scattered queries, query chunks with an additive mask of exactly their key range (the eager CPU
loop) or FlexAttention; `rows.SequenceAttention` attends each sequence of a packed batch to its
own rows. `flex` holds FlexAttention over sorted rows: its block mask built on the device, its
kernel compiled for a few bucketed shapes, a refused compile logged, counted and attended by
query chunks instead.
"""
