"""`clients` moved into the one package `fedsd` (fedsd 0.2, docs/architecture.md).

Not installed: this folder only answers an old import from a checkout with the new place."""
_MOVED = """
    clients                                       -> fedsd.app.client
    clients.app                                   -> fedsd.app.client.client_app
    clients.data_service                          -> fedsd.app.client.owner_service
    clients.local                                 -> fedsd.app.client.handler
    clients.node_config                           -> fedsd.app.client.node_config
    clients.secure_aggregation                    -> fedsd.app.client.secure_stages
"""
raise ImportError("`clients` is now `fedsd.app.client`: every module of it moved into the package fedsd. Old name -> new name:"
                  + _MOVED + "(docs/architecture.md)")
