"""The `fedsd` command: one module a command, each parsing its options and calling the room that does
the work (fedsd/simulation, fedsd/deployment, fedsd/benchmarks, the library); `main.py` is the entry
point, and the only module that loads the checkout's studies (simulations/, `fedsd reproduce`)."""
