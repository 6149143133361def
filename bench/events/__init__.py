"""`kvsieve bench events`: KV events for routers (`kvsieve serve --kv-events`), read by a real
Dynamo indexer running from the venv setup_dynamo.sh builds."""
