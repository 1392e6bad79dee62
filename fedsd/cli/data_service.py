"""`fedsd data-service`: a client machine's data service, the owner's process that alone reads the
node's data, state and budget (fedsd/app/client/owner_service.py, clients/README.md)."""
from __future__ import annotations

try:  # a client machine's data service (Flower's); without Flower, central training still works
    from fedsd.app.client.owner_service import add_service_arguments, run_service
except ImportError:
    add_service_arguments = run_service = None


def add_data_service_parser(sub) -> None:
    if add_service_arguments is None:  # Flower not installed: no client machine to serve
        return

    p = sub.add_parser("data-service", help="a client machine's data service: the owner's process that alone reads "
                                            "the node's data, state and budget (clients/README.md)",
                       description="Run as the data owner, from the owner's installation. The SuperNode (another user) "
                                   "gets --node-config \"partition-id=K service='SOCKET'\"; its ClientApp only "
                                   "forwards messages here.")
    add_service_arguments(p)
    p.set_defaults(func=run_service)
