/*
 * tvmkv's stand-in for src/support/process_id.h of the TVM tree, which the Disco NCCL backend includes
 * (tvmkv/disco/nccl.py copies it to src/support/ of the build tree); that backend uses nothing from it.
 */
#ifndef TVMKV_DISCO_SUPPORT_PROCESS_ID_H_
#define TVMKV_DISCO_SUPPORT_PROCESS_ID_H_
#endif  // TVMKV_DISCO_SUPPORT_PROCESS_ID_H_
