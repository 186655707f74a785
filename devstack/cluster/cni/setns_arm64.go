package main

// sysSetns is setns(2)'s number on arm64 (Go's syscall package does not name it).
const sysSetns = 268
