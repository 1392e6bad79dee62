"""Secure aggregation with distributed noise: SecAgg+ with signed stages (secagg), owners'
identities and the roster (identity), how large an honest sum can be (sum_bound), quantisation
and Skellam shares with their accountant (distributed_noise), a client's share of a step and the
server's step on the sum (distributed_step), and client-level protection (client_level)."""
