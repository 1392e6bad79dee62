"""What the ClientApp (fedsd/app/client/) and the ServerApp (fedsd/app/server/) share, as Flower's app layout has
it: the wire format (records), the public-data partitioner for simulations (partition) and a
simulated federation's data side (federation). Neither app imports the other."""
