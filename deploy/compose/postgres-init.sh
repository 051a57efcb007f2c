#!/bin/bash
# Runs once, when the postgres image initialises its data directory: the server then reads the
# pipeline's settings (deploy/postgres/pipeline.conf, mounted at /etc/postgresql/pipeline.conf)
# after its own, from the next start on (the image restarts the server after its init scripts).
set -euo pipefail
echo "include '/etc/postgresql/pipeline.conf'" >> "$PGDATA/postgresql.conf"
