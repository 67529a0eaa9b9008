#!/bin/bash
# Runs in the work dir before step two's agent (Harbor: steps/<name>/workdir/setup.sh).
printf 'the lazy dog\n' >> sample.txt
