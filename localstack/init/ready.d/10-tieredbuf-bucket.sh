#!/bin/sh
# LocalStack init hook (runs when LocalStack is ready): create the tieredbuf bucket.
# Mounted at /etc/localstack/init/ready.d/ by localstack/docker-compose.yml.
set -eu
BUCKET="${TIEREDBUF_BUCKET:-tieredbuf}"
awslocal s3api head-bucket --bucket "$BUCKET" 2>/dev/null \
  || awslocal s3 mb "s3://$BUCKET"
echo "tieredbuf: bucket $BUCKET ready"
