"""Reading compiled XLA programs: a compiled program's HLO text (`text`), the collectives of an HLO text and the
mesh axes they run over (`collectives`), the ring algorithm's bytes per collective (`ring`), matmul FLOPs per
device (`flops`), collectives that devices may start in different orders (`collective_order`), and the XLA:CPU
options that make such checks compile fast (`compile_options`)."""
