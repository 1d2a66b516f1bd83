#!/bin/sh
# Creates the secret files deploy/compose.yaml mounts under /run/secrets, in deploy/secrets/ (git-ignored)
# or DIR, and leaves alone any that exist: random passwords and tokens, the database and Redis URLs made
# from those passwords, and empty files for the optional secrets (vendor keys, the master key) to fill in.
#     sh deploy/new-secrets.sh [DIR]
set -eu
dir=${1:-$(dirname "$0")/secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"  # the files must be readable by the containers' users; the directory keeps others out

random() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }
new() { [ -e "$dir/$1" ] || printf '%s\n' "$2" >"$dir/$1"; }  # new NAME VALUE

new postgres_password "$(random)"
new redis_password "$(random)"
new database_url "postgresql+asyncpg://weir:$(cat "$dir/postgres_password")@postgres:5432/weir"
new redis_url "redis://:$(cat "$dir/redis_password")@redis:6379/0"
new weir_admin_token "wa-$(random)"
new weir_demo_key "sk-weir-demo-$(random)"
new grafana_admin_password "$(random)"
new weir_master_key ""     # optional: `weir db new-master-key` output, to store vendor keys encrypted
new openai_api_key ""      # optional vendor keys
new anthropic_api_key ""
chmod 644 "$dir"/*
echo "secrets in $dir"
