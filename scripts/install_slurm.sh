#!/usr/bin/env bash
# Install a one-node Slurm (Debian's slurmctld, slurmd, slurm-client, munge) for tests/integration/test_slurm.py.
# Needs root and apt-get; does nothing when slurmctld, slurmd, sbatch and munged are already installed.
# Exit 0: installed (or already there); 3: cannot install here (not root / no apt-get), the tests skip.
set -euo pipefail
have() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have sbatch && have munged; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: need root and apt-get to install Slurm" >&2
  exit 3
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
