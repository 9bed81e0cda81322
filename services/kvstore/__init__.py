"""The kvstore service (default 127.0.0.1:8100): the latent block store over HTTP.

    python -m services.kvstore --fingerprint FP --num-layers N --volume DIR [--volume DIR ...] \\
        --redis-url redis://USER@127.0.0.1:6379/0      # or DEEPINFER_KVSTORE_* env vars
    secrets only from DEEPINFER_KVSTORE_{SERVICE_TOKEN,MAC_KEY,ADMIN_TOKEN,REDIS_PASSWORD}[_FILE]

Data (msgpack bodies, see wire.py; errors are 4xx JSON {"error", "field"}), each with
`Authorization: Bearer <service token>` (401 without, 403 with a wrong one):
    POST   /v1/segments           save new blocks of a chain -> {"blocks", "segments", "bytes"}
    POST   /v1/read               one verified layer of a hit -> raw latents, X-Valid-Blocks
    POST   /v1/lookup             longest cached prefix of a chain -> {"root", "hashes", "runs"}
    DELETE /v1/segments/{id}      unpublish a segment (its bytes go after the reader grace)
Operations: GET /healthz, /readyz (Redis and every volume), /metrics (Prometheus);
with `Authorization: Bearer <admin token>`: GET /admin/stats, /admin/volumes,
POST /admin/sweep, POST /admin/evict {"tenant": ...} | {"all": true}.
Client for engines without the volumes mounted: services.kvstore.client.KvstoreClient.
"""
