"""Simulated federations (as `flwr.simulation` is Flower's): fedsd's app on Flower's simulation
engine (`engine`), the in-process federation under secure aggregation with distributed noise
(`secure_federation`), a data set cut into client folders (`client_folders`) and a study's runs
on disk (`sweeps`). The commands in fedsd/cli parse their options and call these."""
